"""A mixture of experts resumed under another expert-parallel layout continues the same training.

A checkpoint holds each expert under its global index whatever the EP size (pipe/moe/moe_checkpoint.py), and the
experts' optimizer state, cut over their expert-data-parallel groups, is re-cut by name. Real launches of
pretrain_gpt.py (4 ranks, gloo, fp32, no dropout) through universal_capture.py, which writes the fp32 master
weights, Adam's moments and the module's weights by parameter name at a save and right after a load:
- EP 2 x PP 2 x DP 2 runs 6 iterations, saving at 3 (the uninterrupted reference), and EP 1 x PP 2 x DP 2 runs 3
  under zbv, saving at 3; side by side;
- then, side by side: the EP 2 step under EP 4 x PP 1 x DP 4 (a plain --load: re-cut by name), the EP 1 step
  under EP 2 x PP 2 x DP 2, and the EP 2 step converted to a universal checkpoint under EP 2 x PP 1 x DP 4.
Each resume restores the saved optimizer state bit for bit and its iterations 4..6 equal the uninterrupted
run's (rel 1e-5: the layouts sum gradients in other orders).
"""
import json

import pytest
import torch

from megatron_ds.testing.corpus import write_corpus
from tests.training.checkpoint.test_universal_checkpoint import _convert, _side_by_side, assert_same_tensors, captured

SAVE_AT, ITERS = 3, 6
MODEL = ("--num-layers", "2", "--num-attention-heads", "2", "--swiglu", "--ffn-hidden-size", "32",
         "--normalization", "rmsnorm", "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-samples", str(8 * ITERS), "--adam-eps", "1e-6",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01",
         "--moe-z-loss-coeff", "0.001", "--moe-shared-expert-intermediate-size", "16")


def ep(size):
    return ("--expert-model-parallel-size", str(size))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_resume")
    write_corpus(str(tmp / "corpus"))
    zbh1 = tmp / "zb-h1.json"
    zbh1.write_text(json.dumps({"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                               "pipeline": {"schedule": "zb-h1"}}))
    capture = lambda name: ("--capture-dir", str(tmp / "capture" / name))  # noqa: E731
    ep2, ep1 = tmp / "ep2", tmp / "ep1"
    saving = _side_by_side(tmp, {
        "ep2_pp2": ((*ep(2), "--save", str(ep2), "--save-interval", str(SAVE_AT), *capture("ep2_pp2")), 4),
        "ep1_pp2": ((*ep(1), "--save", str(ep1), "--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT),
                     *capture("ep1_pp2")), 4, {"ds_config": zbh1})}, MODEL)
    _convert(ep2 / f"global_step{SAVE_AT}")
    (ep2 / "latest").write_text(f"global_step{SAVE_AT}")  # the uninterrupted run saved at 6 too
    pp1 = ("--pipeline-model-parallel-size", "1")
    resumed = _side_by_side(tmp, {
        "ep4_pp1": ((*ep(4), *pp1, "--load", str(ep2), *capture("ep4_pp1")), 4),
        "ep2_from_ep1": ((*ep(2), "--load", str(ep1), *capture("ep2_from_ep1")), 4),
        "universal_ep2_pp1": ((*ep(2), *pp1, "--load", str(ep2), "--universal-checkpoint",
                               *capture("universal_ep2_pp1")), 4)}, MODEL)
    return dict(saving=saving, resumed=resumed, tmp=tmp)


def test_expert_parallel_sizes_train_alike(runs):
    full, ep1 = runs["saving"]["ep2_pp2"][0], runs["saving"]["ep1_pp2"][0]
    assert [r["iteration"] for r in full] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in ep1] == list(range(1, SAVE_AT + 1))
    for a, b in zip(ep1, full):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (ep1, full)


@pytest.mark.parametrize("layout, source, how", [
    ("ep4_pp1", "ep2_pp2", "re-cut parameter by parameter"),
    ("ep2_from_ep1", "ep1_pp2", "re-cut parameter by parameter"),
    ("universal_ep2_pp1", "ep2_pp2", "universal checkpoint, layout")])
def test_resume_under_another_expert_layout_continues_the_run(runs, layout, source, how):
    records, out = runs["resumed"][layout]
    assert how in out and f"at iteration {SAVE_AT}" in out
    assert [r["iteration"] for r in records] == list(range(SAVE_AT + 1, ITERS + 1))
    ref = runs["saving"]["ep2_pp2"][0][SAVE_AT:]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    worst = max(abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(records, ref))
    print(f"{layout}: losses {[r['loss'] for r in records]}, uninterrupted {[r['loss'] for r in ref]}: "
          f"largest relative difference {worst:.2e}")
    assert worst < 1e-5, (records, ref)
    saved, saved_steps, _ = captured(runs, source, f"save{SAVE_AT}")
    loaded, steps, iterations = captured(runs, layout, "load")
    assert sum(".experts." in name for name in saved) == 4 * 2 * 2  # 4 experts, 2 layers, 2 matrices (SwiGLU's fused)
    assert saved_steps == steps == {SAVE_AT} and iterations == {SAVE_AT}
    assert_same_tensors(loaded, saved, ("fp32", "exp_avg", "exp_avg_sq", "module"), layout)
    biases = buffers(runs, source, f"save{SAVE_AT}")
    assert sorted(biases) == ["1.mlp.router.expert_bias", "2.mlp.router.expert_bias"]
    assert all(b.abs().sum() > 0 for b in biases.values()), "the expert bias never moved"
    loaded_biases = buffers(runs, layout, "load")
    assert biases.keys() == loaded_biases.keys()
    for name, bias in biases.items():
        assert torch.equal(loaded_biases[name], bias), (layout, name, loaded_biases[name], bias)


def buffers(runs, name, label):
    """{name: tensor} of the persistent buffers (the expert biases) every stage's replica 0 captured."""
    out = {}
    for path in (runs["tmp"] / "capture" / name).glob(f"{label}-stage*.pt"):
        out.update(torch.load(path, weights_only=False)["buffers"])
    return out


def test_zero_to_fp32_reads_an_expert_parallel_checkpoint(runs, tmp_path):
    """The EP 2 run's step, consolidated by the zero_to_fp32.py its save folder holds (a single-process model):
    every expert's weights as the run held them when it saved."""
    import subprocess
    import sys
    folder = runs["tmp"] / "ep2"
    proc = subprocess.run([sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(tmp_path), "-t",
                           f"global_step{SAVE_AT}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    saved, _, _ = captured(runs, "ep2_pp2", f"save{SAVE_AT}")
    experts = {name: v["module"] for name, v in saved.items() if ".experts." in name}
    assert len(experts) == 16
    for name, weight in experts.items():
        layer, rest = name.split(".", 1)
        assert torch.equal(state[f"layers.{int(layer) - 1}.{rest}"], weight), name
