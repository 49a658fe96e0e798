"""megatron_ds.initialize on DeepSpeed PipelineModules that are not our GPT (tests/foreign_harness.py: a
Linear/Tanh stack, a model with tied layers, a conv classifier with norms, parameter-free layers and a tuple of
tensors between stages) equals sequential gradient accumulation on one process: every step's loss, the eval
loss and the weights after 3 AdamW steps within 1e-5 (fp32), under every schedule but seq1f1b, at PP=2, PP=4
and PP=2 x DP=2 with ZeRO-1; also ZeRO-0, gradient clipping, post-validation, an optimizer of two param
groups and activations whose shape changes with every micro-batch (dynamic_shape). One launch per layout runs
every case. The split schedules leave weight gradients to W ops (through autograd); the others none; under
DeepSpeed's reentrant activation checkpointing B runs every chunk's backward whole and says so once per chunk."""
import pytest
import torch

from tests.foreign_harness import MODELS, assert_matches, rank_runs, reference_run
from megatron_ds.testing.launcher import run_ranks

STEPS = 3
EVERY = ["1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "zbv", "zbv-half", "zbv-min", "bitpipe", "dualpipev"]
SPLIT = {"zb-h1", "zb-h2", "zbv", "zbv-half", "zbv-min", "dualpipev"}


def section(name):
    return {"schedule": name, **({"virtual_stages": 2} if name == "interleaved" else {})}


def cases(schedules, extra=()):
    return [(model, section(name), 0.0, 1) for model in MODELS for name in schedules] + list(extra)


LAYOUTS = {
    "pp2": (2, 2, 4, cases(EVERY, extra=[  # DeepSpeed's (reentrant) activation checkpointing: B runs it whole
        ("linear_tanh", {"schedule": "zbv", "activation_checkpoint_interval": 2}, 0.0, 1),
        # sequences of 1 to 3 tokens, the length changing with every micro-batch (dynamic_shape)
        ("dynamic", {"schedule": "zbv"}, 0.0, 1), ("dynamic", {"schedule": "dualpipev"}, 0.0, 1),
        ("dynamic", {"schedule": "interleaved", "virtual_stages": 2}, 0.0, 1)])),
    "pp4": (4, 4, 8, cases(EVERY)),
    "pp2xdp2": (4, 2, 4, cases(EVERY, extra=[
        ("conv_norm", {"schedule": "zbv", "post_validation": True}, 0.05, 1),  # clipping that bites
        ("tied", {"schedule": "zb-h1"}, 0.05, 1),
        ("linear_tanh", {"schedule": "zbv"}, 0.0, 0),  # ZeRO stage 0
        # an optimizer of two param groups (biases: no weight decay, twice the lr), rebound by name
        ("linear_tanh", {"schedule": "zbv"}, 0.0, 1, True), ("conv_norm", {"schedule": "dualpipev"}, 0.0, 1, True)])),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_foreign_models_match_reference(layout):
    world, pp, gas, runs = LAYOUTS[layout]
    per_rank = run_ranks(world, rank_runs, pp, gas, STEPS, runs, timeout=900)
    refs = {}
    for i, (model, pipeline, clip, _, *groups) in enumerate(runs):
        key = (model, clip, bool(groups))
        ref = refs.setdefault(key, reference_run(model, (world // pp) * gas, STEPS, clip, groups=bool(groups)))
        results = [r[i] for r in per_rank]
        try:
            assert_matches(results, ref)
        except AssertionError as exc:
            raise AssertionError(f"{model} {pipeline} clip={clip}: {exc}") from None
        assert {r["engine"] for r in results} == {"ForeignScheduleEngine"}
        in_w = sum(r["weights_in_w"] for r in results)
        if "activation_checkpoint_interval" in pipeline:  # every chunk's backward whole, said once per chunk
            assert in_w == 0 and all(r["whole"] == ["CheckpointFunction"] * 2 for r in results), results
            continue
        assert (in_w > 0) == (pipeline["schedule"] in SPLIT), (model, pipeline, in_w)
        assert all(r["whole"] == [] for r in results)


def test_a_rank_whose_stages_hold_no_parameters_is_refused_on_every_rank():
    """DeepSpeed's own engine stops such a rank alone ("optimizer got an empty parameter list") while the other
    waits; ours refuses it on every rank, naming the rank, its stages and layers."""
    from tests.foreign_harness import refusals_without_parameters
    per_rank = run_ranks(2, refusals_without_parameters, ["1f1b", "zbv"], timeout=300)
    assert per_rank[0] == per_rank[1]
    one_f, zbv = per_rank[0]
    assert one_f.startswith("schedule '1f1b': pipeline rank 1 holds stage(s) [1] (layers 2-3 of partition_method "
                            "'uniform', bounds [0, 2, 4]), which have no trainable parameters"), one_f
    assert zbv.startswith("schedule 'zbv': pipeline rank 1 holds stage(s) [1, 2] (layers 1-1, 2-2"), zbv
    assert "\n" not in one_f + zbv


def test_shapes_that_change_every_iteration_with_one_micro_batch():
    """dynamic_shape with one micro-batch a step (DeepSpeed's TestPipeDynamicShape): the gradient's receive,
    posted ahead of the F that sends its activation, waits for this iteration's shape, not the last one's."""
    runs = [("dynamic", {"schedule": name}, 0.0, 1) for name in ("1f1b", "zbv")]
    per_rank = run_ranks(2, rank_runs, 2, 1, STEPS, runs, timeout=300)
    ref = reference_run("dynamic", 1, STEPS)
    for i in range(len(runs)):
        assert_matches([r[i] for r in per_rank], ref)


def test_a_model_without_a_loss_evaluates_to_its_output():
    """DeepSpeed's own test of a PipelineModule without loss_fn (tests/unit/pipe/test_pipe_module.py): labels
    a placeholder int, eval_batch the mean of the last layer's one-element outputs, on every rank."""
    from tests.foreign_harness import outputs_without_loss
    per_rank = run_ranks(2, outputs_without_loss, ["1f1b", "zbv"], timeout=300)
    for values, reference in per_rank:
        for value in values:
            assert torch.allclose(value.reshape(()), reference.reshape(()), rtol=0, atol=1e-6), (value, reference)


@pytest.mark.parametrize("model,schedule", [("tied", "zbv")])
def test_checkpoints_load_in_deepspeeds_engine_and_back(tmp_path, model, schedule):
    """A step saved under zbv (our engine, V placement) loads into DeepSpeed's stock engine (DeepSpeed's layer
    files, each layer by its global index), which trains on from it and saves; that loads into ours again."""
    from tests.foreign_harness import checkpoint_round_trip
    per_rank = run_ranks(2, checkpoint_round_trip, model, 2, 4, schedule, str(tmp_path), timeout=600)
    assert {r["stock_engine"] for r in per_rank} == {"PipelineEngine"}
    for saved, loaded in (("saved", "stock_loaded"), ("stock_saved", "ours_loaded")):
        want = {k: w for r in per_rank for k, w in r[saved].items()}
        got = {k: w for r in per_rank for k, w in r[loaded].items()}
        assert set(got) == set(want)
        for key, w in got.items():
            assert torch.equal(w, want[key]), (saved, loaded, key)
    # eval_batch's results as the stock engine's, from the rank that holds the loss stage (zbv: rank 0)
    assert [r["stages"]["stock"] for r in per_rank] == [(True, False), (False, True)]
    assert [r["stages"]["ours"] for r in per_rank] == [(True, True), (False, False)]
    stock, ours = per_rank[1]["eval"]["stock"], per_rank[0]["eval"]["ours"]
    assert per_rank[0]["eval"]["stock"]["each"] is None and per_rank[1]["eval"]["ours"]["each"] is None
    for kind in ("mean", "each", "outputs", "logits"):
        a, b = torch.cat(_flat(stock[kind])), torch.cat(_flat(ours[kind]))
        assert a.shape == b.shape, (kind, stock[kind], ours[kind])
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (kind, a, b)
    ref = reference_run(model, 4, 3)  # the stock engine's first loss is the reference's third: same weights
    for r in per_rank:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= 1e-5
        assert abs(r["stock_loss"] - ref["losses"][2]) <= 1e-5


def _flat(value):
    """A result of eval_batch (a tensor, or a list or tuple of them) as a list of flat tensors."""
    if torch.is_tensor(value):
        return [value.reshape(-1)]
    return [torch.cat(_flat(v)) for v in value]
