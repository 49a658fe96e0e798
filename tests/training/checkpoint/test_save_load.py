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
    assert "[[0, 1]] -> pp 2, dp 1 (DP x CP, the CP size not recorded), placement [[0, 1]], vocab_parallel on: " \
        "everything" in p.reason and "wte" not in p.reason  # not the name table


def test_an_expert_parallel_size_shows_on_both_sides():
    """pipeline_layout leaves "ep" out at 1; beside a side with EP 2 the line writes it out."""
    saved = {"pp": 1, "dp": 4, "placement": [[0]], "ep": 2, "tp": 1}
    layout = {"pp": 1, "dp": 4, "placement": [[0]], "tp": 1}
    saved, layout = {**saved, "cp": 1}, {**layout, "cp": 2}
    assert plan(saved, layout).reason == ("pipeline layout pp 1, dp 4 x cp 1, placement [[0]], ep 2, tp 1 -> "
                                          "pp 1, dp 2 x cp 2, placement [[0]], ep 1, tp 1: everything, the "
                                          "optimizer state re-cut parameter by parameter")
    assert "ep 1, tp 1 -> pp 1, dp 4 x cp 1, placement [[0]], ep 2" in plan(layout, saved).reason
    assert "ep" not in plan(ZBV, ONE_F_ONE_B).reason  # neither side has experts split


def test_the_data_axis_shows_dp_and_cp_apart():
    """pipeline_layout's "dp" is the data axis, DP x CP: the line shows the two sizes, and says when the checkpoint
    records no CP size; ZeRO's shards are cut over the whole axis, so DP 2 x CP 1 -> DP 1 x CP 2 loads as saved."""
    saved, layout = {**ONE_F_ONE_B, "dp": 4, "cp": 2}, {**ZBV, "dp": 4, "cp": 1}
    assert plan(saved, layout).reason.startswith("pipeline layout pp 2, dp 2 x cp 2, placement [[0, 1]] -> pp 2, "
                                                 "dp 4 x cp 1, placement [[0, 1, 1, 0]]: ")
    unknown = plan({**saved, "cp": None}, layout).reason
    assert unknown.startswith("pipeline layout pp 2, dp 4 (DP x CP, the CP size not recorded), placement [[0, 1]] "
                              "-> pp 2, dp 4 x cp 1, "), unknown
    moved = plan({**ZBV, "dp": 2, "cp": 1}, {**ZBV, "dp": 2, "cp": 2})
    assert moved.optimizer == "deepspeed" and moved.reason == (
        "same pipeline layout (pp 2, dp 2 x cp 1, placement [[0, 1, 1, 0]] -> pp 2, dp 1 x cp 2, placement "
        "[[0, 1, 1, 0]]: the data axis DP x CP alike): everything")
    assert plan({**ZBV, "cp": None}, {**ZBV, "cp": 1}).reason == "same pipeline layout: everything"


def test_the_saved_cp_size_is_read_from_the_checkpoints_args():
    import argparse
    from megatron_ds.training.checkpoint.save_load import saved_cp
    assert saved_cp({"args": argparse.Namespace(context_parallel_size=2)}) == 2
    assert saved_cp({"args": argparse.Namespace(tensor_model_parallel_size=1)}) is None  # saved before CP existed
    assert saved_cp({}) is None  # DeepSpeed's own engine's checkpoint: no args of ours
