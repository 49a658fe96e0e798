"""megatron_ds.initialize on DeepSpeed PipelineModules that are not our GPT (tests/foreign_harness.py: a
Linear/Tanh stack, a model with tied layers, a conv classifier with norms, parameter-free layers and a tuple of
tensors between stages) equals sequential gradient accumulation on one process: every step's loss, the eval
loss and the weights after 3 AdamW steps within 1e-5 (fp32), under every schedule but seq1f1b, at PP=2, PP=4
and PP=2 x DP=2 with ZeRO-1; also ZeRO-0, gradient clipping and post-validation. One launch per layout runs
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
        ("linear_tanh", {"schedule": "zbv", "activation_checkpoint_interval": 2}, 0.0, 1)])),
    "pp4": (4, 4, 8, cases([n for n in EVERY if n != "gpipe"])),
    "pp2xdp2": (4, 2, 4, cases([n for n in EVERY if n != "gpipe"], extra=[
        ("conv_norm", {"schedule": "zbv", "post_validation": True}, 0.05, 1),  # clipping that bites
        ("tied", {"schedule": "zb-h1"}, 0.05, 1),
        ("linear_tanh", {"schedule": "zbv"}, 0.0, 0)])),  # ZeRO stage 0
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_foreign_models_match_reference(layout):
    world, pp, gas, runs = LAYOUTS[layout]
    per_rank = run_ranks(world, rank_runs, pp, gas, STEPS, runs, timeout=900)
    refs = {}
    for i, (model, pipeline, clip, _) in enumerate(runs):
        ref = refs.setdefault((model, clip), reference_run(model, (world // pp) * gas, STEPS, clip))
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
