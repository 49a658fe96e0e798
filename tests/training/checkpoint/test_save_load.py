"""save_load.plan_load: the one place that decides what of a checkpoint loads."""
import pytest

from megatron_ds.training.checkpoint.save_load import CheckpointError, plan_load

ZBV = {"pp": 2, "dp": 1, "placement": [[0, 1, 1, 0]]}
ONE_F_ONE_B = {"pp": 2, "dp": 1, "placement": [[0, 1]]}


def plan(saved, layout, finetune=False, no_load_optim=False, zero_stage=1):
    return plan_load(saved, layout, finetune=finetune, no_load_optim=no_load_optim, zero_stage=zero_stage)


def test_same_layout_loads_everything_as_saved():
    p = plan(ZBV, ZBV)
    assert (p.optimizer, p.progress) == ("deepspeed", True)


def test_another_layout_recuts_the_optimizer_and_keeps_progress():
    p = plan(ZBV, ONE_F_ONE_B)
    assert (p.optimizer, p.progress) == ("by_name", True)
    assert (plan({**ZBV, "pp": 4}, ZBV).optimizer, plan({**ZBV, "dp": 2}, ZBV).optimizer) == ("by_name", "by_name")


def test_finetune_loads_neither_optimizer_nor_progress_no_load_optim_keeps_progress():
    assert (plan(ZBV, ONE_F_ONE_B, finetune=True).optimizer, plan(ZBV, ZBV, finetune=True).progress) == (None, False)
    p = plan(ZBV, ONE_F_ONE_B, no_load_optim=True)
    assert (p.optimizer, p.progress) == (None, True)


def test_another_layout_without_zero_shards_is_refused():
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        plan(ZBV, ONE_F_ONE_B, zero_stage=0)
    assert plan(ZBV, ZBV, zero_stage=0).optimizer == "deepspeed"


def test_vocabulary_parallelism_switched_on_is_another_layout_shown_as_on():
    names = {f"{i}.vocab_slice.wte": f"{i}.wte.weight" for i in range(2)}  # as vocab_slices.whole_names maps them
    p = plan(ONE_F_ONE_B, {**ONE_F_ONE_B, "vocab_parallel": names})
    assert p.optimizer == "by_name"
    assert "'vocab_parallel': True}: everything" in p.reason and "wte" not in p.reason  # not the name table


def test_an_expert_parallel_size_shows_on_both_sides():
    """pipeline_layout leaves "ep" out at 1; beside a side with EP 2 the line writes it out."""
    saved = {"pp": 1, "dp": 4, "placement": [[0]], "ep": 2, "tp": 1}
    layout = {"pp": 1, "dp": 4, "placement": [[0]], "tp": 1}
    assert plan(saved, layout).reason == ("pipeline layout {'pp': 1, 'dp': 4, 'placement': [[0]], 'ep': 2, 'tp': 1} -> "
                                          "{'pp': 1, 'dp': 4, 'placement': [[0]], 'ep': 1, 'tp': 1}: everything, the "
                                          "optimizer state re-cut parameter by parameter")
    assert "'ep': 1, 'tp': 1} -> {'pp': 1, 'dp': 4, 'placement': [[0]], 'ep': 2" in plan(layout, saved).reason
    assert "ep" not in plan(ZBV, ONE_F_ONE_B).reason  # neither side has experts split
