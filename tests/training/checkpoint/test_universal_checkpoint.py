"""Another TP x PP x DP through DeepSpeed's universal checkpoint, end to end (gloo, LLaMA-style: GQA,
SwiGLU, untied head, so the QKV and gate|up sub-parameter splits are exercised).

Two TP=2 x PP=2 runs (4 ranks each, fp32 and bf16, side by side) are both the uninterrupted references
and, saving at iteration 3, the checkpoints; DeepSpeed's own converter (python -m
megatron_ds.training.checkpoint.universal, which runs deepspeed.checkpoint.ds_to_universal) makes the universal folders; then every resume runs side by side:
- fp32 at PP=2 x DP=2 and at TP=1 x PP=1 (1 rank): iterations 4..8 equal the uninterrupted run's
  (rel 1e-5), with its consumed samples and lr; so does a plain --load of the step at TP=2 x PP=1 x DP=2 (the
  optimizer state re-cut by name from each TP rank's own shards);
- a third (TP=1, --no-load-optim) shows the optimizer state is what keeps the losses equal;
- bf16 at TP=1 x PP=1: losses within bf16 rounding of the bf16 run's;
- --finetune from the bf16 checkpoint at TP=1 x PP=1: the weights alone, iteration 0, a fresh Adam.
Every launch runs pretrain_gpt.py through universal_capture.py, which writes the fp32 master weights and
Adam's moments and step, whole and by name, at a save and right after a load: a resume's equal the saved
ones bit for bit. The TP=1 run's final checkpoint and the TP=2 run's, exported to Hugging Face (TP shards
merged), give the same logits.
"""
import concurrent.futures
import math
import os
import subprocess
import sys

import pytest

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_resume import launch

SAVE_AT, ITERS = 3, 8
# bf16 matmuls are 2-4x slower than fp32 on CPU: the bf16 runs stop at 5, the finetuning after 2 steps (its lr
# schedule is the bf16 run's: --lr-decay-samples)
BF16_ITERS, FINETUNE_ITERS = 5, 2
BF16 = ("--bf16", "--train-samples", str(8 * BF16_ITERS))
LLAMA = ("--num-layers", "4", "--num-attention-heads", "4", "--num-key-value-heads", "2", "--swiglu",
         "--ffn-hidden-size", "48", "--normalization", "rmsnorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-samples", str(8 * ITERS),
         # the padding of TP=2 for every layout: the padded rows are trained weights in the softmax
         "--pad-vocab-size-to", "50432")


CAPTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "universal_capture.py")


def _convert(step_dir):
    cmd = [sys.executable, "-m", "megatron_ds.training.checkpoint.universal", "--input_folder", str(step_dir),
           "--output_folder", f"{step_dir}_universal", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _side_by_side(tmp, runs, model=LLAMA):
    """{name: launch(tmp, name, ...)} of runs {name: (args, nproc[, launch's keywords])}, all at once (the ranks
    mostly wait), each rank forked from the fork server (launch's "forked": these cases are layouts, not
    launchers; ~4 s of CPU of imports less a rank)."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(launch, tmp, name, *run[0], nproc=run[1], hard=model, entry=CAPTURE,
                                     **{"launcher": "forked", **(run[2] if len(run) > 2 else {})})
                   for name, run in runs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fp32 and the bf16 TP=2 x PP=2 runs save at iteration 3 and are converted; then every resume, side by
    side. Each launch writes its optimizer state at its saves and after its load into tmp/capture/<name>."""
    tmp = tmp_path_factory.mktemp("universal")
    write_corpus(str(tmp / "corpus"))
    ckpt, bf16 = tmp / "ckpt", tmp / "bf16"
    capture = lambda name: ("--capture-dir", str(tmp / "capture" / name))  # noqa: E731
    saving = {"tp2_pp2": (ckpt, ()), "bf16_tp2_pp2": (bf16, BF16)}
    full = _side_by_side(tmp, {name: (("--tensor-model-parallel-size", "2", "--save", str(folder), "--save-interval",
                                       str(SAVE_AT), *flags, *capture(name)), 4)
                               for name, (folder, flags) in saving.items()})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(_convert, [folder / f"global_step{SAVE_AT}" for folder, _ in saving.values()]))
    assert (ckpt / "latest_universal").read_text() == f"global_step{SAVE_AT}_universal"
    pp1 = ("--pipeline-model-parallel-size", "1")
    resumes = {"pp2_dp2": ((), 4, ckpt),
               "tp1_pp1": ((*pp1, "--save", str(tmp / "tp1")), 1, ckpt),
               "tp1_fresh_adam": ((*pp1, "--no-load-optim"), 1, ckpt),
               "bf16_tp1_pp1": ((*BF16, *pp1), 1, bf16),
               # --finetune: weights only; its final save shows the fresh optimizer's step count
               "bf16_finetune_tp1_pp1": ((*BF16, "--train-samples", str(8 * FINETUNE_ITERS), "--lr-decay-samples",
                                          str(8 * BF16_ITERS), *pp1, "--finetune", "--save", str(tmp / "finetune")),
                                         1, bf16)}
    # and a plain --load at the same TP under another PP x DP (the optimizer state re-cut by name, each TP rank
    # from its own TP rank's shards: training/checkpoint/relayout.py)
    (ckpt / "latest").write_text(f"global_step{SAVE_AT}")
    by_name = {"tp2_pp1_dp2_by_name": (("--load", str(ckpt), "--tensor-model-parallel-size", "2", *pp1,
                                        *capture("tp2_pp1_dp2_by_name")), 4)}
    resumed = _side_by_side(tmp, {**{name: (("--load", str(folder), "--universal-checkpoint", *args, *capture(name)),
                                            nproc) for name, (args, nproc, folder) in resumes.items()}, **by_name})
    return dict(full=full["tp2_pp2"][0], bf16_full=full["bf16_tp2_pp2"][0], resumed=resumed, ckpt=ckpt, tmp=tmp)


def captured(runs, name, label):
    """{parameter name: {fp32, exp_avg, exp_avg_sq, module}} of every stage, with the steps and iteration."""
    import torch
    files = sorted((runs["tmp"] / "capture" / name).glob(f"{label}-stage*.pt"))
    assert files, f"{name} wrote no {label} capture"
    parts = [torch.load(f, weights_only=False) for f in files]
    params = {k: v for part in parts for k, v in part["params"].items()}
    assert sum(len(part["params"]) for part in parts) == len(params)  # every parameter on one stage
    return params, {s for part in parts for s in part["steps"]}, {part["iteration"] for part in parts}


def assert_same_tensors(got, want, keys, what):
    """Bit-equal, parameter by parameter (whole tensors, so any TP x PP x DP layout compares)."""
    import torch
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in got:
        for key in keys:
            a, b = got[name][key], want[name][key]
            assert a is not None and b is not None, (what, name, key)
            assert a.dtype == b.dtype and a.shape == b.shape, (what, name, key, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), f"{what}: {name} {key} differs by {(a.float() - b.float()).abs().max():.3g}"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["pp2_dp2", "tp1_pp1", "tp2_pp1_dp2_by_name"])
def test_resume_under_another_layout_continues_the_run(runs, layout):
    full = runs["full"]
    assert [r["iteration"] for r in full] == list(range(1, ITERS + 1))
    records, out = runs["resumed"][layout]
    how = "re-cut parameter by parameter" if layout.endswith("by_name") else "universal checkpoint, layout"
    assert how in out and f"at iteration {SAVE_AT}" in out
    assert [r["iteration"] for r in records] == list(range(SAVE_AT + 1, ITERS + 1))  # 5 iterations
    ref = full[SAVE_AT:]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in ref], rel=1e-12)
    worst = max(abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(records, ref))
    print(f"{layout}: losses {[r['loss'] for r in records]}, uninterrupted {[r['loss'] for r in ref]}: "
          f"largest relative difference {worst:.2e}")
    assert worst < 1e-5, (records, ref)
    # the fp32 master weights and Adam's moments and step come back exactly
    saved, saved_steps, _ = captured(runs, "tp2_pp2", f"save{SAVE_AT}")
    loaded, steps, iterations = captured(runs, layout, "load")
    assert saved_steps == steps == {SAVE_AT} and iterations == {SAVE_AT}
    assert_same_tensors(loaded, saved, ("fp32", "exp_avg", "exp_avg_sq", "module"), layout)


# bf16 keeps 8 significant bits: one rounding moves a value by up to 2**-8 of it (bf16's unit roundoff). The
# resumed run starts from bit-equal fp32 masters, hence bit-equal bf16 weights (both checked exactly); what
# differs is where the layouts round (TP=2 adds two bf16 partial products that TP=1 rounds once), so each loss,
# a mean over the batch's 128 tokens, stays within about one unit roundoff. Measured: below 1e-5 (this tiny
# model's loss sits near ln(vocab), which damps them), so the loss check cannot tell a lost Adam state (1.3e-4
# in fp32) from rounding: the exact comparison of the optimizer state does.
BF16_LOSS_RTOL = 2 ** -8


@pytest.mark.timeout(1800)
def test_bf16_resume_under_another_layout_restores_master_weights_and_adam_exactly(runs):
    """bf16 TP=2 x PP=2, saved at iteration 3, resumed at TP=1 x PP=1: the fp32 master weights, Adam's moments and
    step equal the saved ones bit for bit (by name), so do the bf16 weights cast from them; the losses follow the
    uninterrupted bf16 run within bf16 rounding (the layouts round differently, BF16_LOSS_RTOL)."""
    import torch
    saved, saved_steps, _ = captured(runs, "bf16_tp2_pp2", f"save{SAVE_AT}")
    loaded, steps, iterations = captured(runs, "bf16_tp1_pp1", "load")
    assert saved_steps == steps == {SAVE_AT} and iterations == {SAVE_AT}
    assert {v["module"].dtype for v in loaded.values()} == {torch.bfloat16}
    assert_same_tensors(loaded, saved, ("fp32", "exp_avg", "exp_avg_sq", "module"), "bf16 tp1_pp1")
    full = runs["bf16_full"]
    records, out = runs["resumed"]["bf16_tp1_pp1"]
    assert "universal checkpoint, layout" in out and f"at iteration {SAVE_AT}" in out
    assert [r["iteration"] for r in records] == list(range(SAVE_AT + 1, BF16_ITERS + 1))
    ref = full[SAVE_AT:]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in ref], rel=1e-12)
    worst = max(abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(records, ref))
    fp32 = abs(full[0]["loss"] - runs["full"][0]["loss"]) / runs["full"][0]["loss"]  # the same weights at iteration 1
    print(f"bf16 tp1_pp1: losses {[r['loss'] for r in records]}, uninterrupted {[r['loss'] for r in ref]}: "
          f"largest relative difference {worst:.2e} (bf16 vs fp32, iteration 1: {fp32:.2e})")
    assert worst < BF16_LOSS_RTOL, (records, ref)
    assert fp32 > 0  # the bf16 run is a bf16 run


@pytest.mark.timeout(1800)
def test_finetune_from_universal_loads_the_weights_alone(runs):
    """--finetune --universal-checkpoint (bf16 TP=2 x PP=2 -> TP=1 x PP=1): the fp32 master weights (and the bf16
    weights) are the saved ones bit for bit, the iteration, data position and lr schedule start afresh, Adam has
    no state; training proceeds, and Adam counts only the finetuning steps."""
    saved, _, _ = captured(runs, "bf16_tp2_pp2", f"save{SAVE_AT}")
    loaded, steps, iterations = captured(runs, "bf16_finetune_tp1_pp1", "load")
    assert iterations == {0} and steps == set()
    assert all(v["exp_avg"] is None and v["exp_avg_sq"] is None for v in loaded.values())
    assert_same_tensors(loaded, saved, ("fp32", "module"), "finetune")
    records, out = runs["resumed"]["bf16_finetune_tp1_pp1"]
    assert "universal checkpoint, layout" in out and "weights only" in out and "at iteration 0" in out
    full = runs["bf16_full"][:FINETUNE_ITERS]
    assert [r["iteration"] for r in records] == list(range(1, FINETUNE_ITERS + 1))
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in full]
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in full], rel=1e-12)
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in records)
    final, final_steps, final_iterations = captured(runs, "bf16_finetune_tp1_pp1", f"save{FINETUNE_ITERS}")
    assert final_steps == {FINETUNE_ITERS} and final_iterations == {FINETUNE_ITERS}  # not SAVE_AT + 2: a fresh Adam
    moved = max((final[k]["fp32"] - loaded[k]["fp32"]).abs().max().item() for k in final)
    print(f"finetune: losses {[r['loss'] for r in records]}; weights moved by up to {moved:.2e} in "
          f"{FINETUNE_ITERS} steps")
    assert moved > 0


@pytest.mark.timeout(1800)
def test_no_load_optim_keeps_the_weights_and_starts_adam_afresh(runs):
    """--no-load-optim under --universal-checkpoint: iteration 4's loss (before its step) is the run's,
    the next ones are not: the optimizer state the resumes restore (compared exactly) keeps them equal."""
    records, out = runs["resumed"]["tp1_fresh_adam"]
    assert "weights, lr schedule and iteration" in out
    ref = runs["full"][SAVE_AT:]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    assert records[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    diff = abs(records[1]["loss"] - ref[1]["loss"]) / ref[1]["loss"]
    print(f"fresh Adam: iteration {SAVE_AT + 2} loss differs from the run's by {diff:.2e} (relative)")
    assert diff > 1e-5


@pytest.mark.timeout(1800)
def test_hf_export_merges_tensor_parallel_shards(runs, tmp_path):
    """The TP=2 run's final checkpoint and the TP=1 resumed run's, exported: equal logits (the runs
    agree to ~1e-7, see above), and the same weights where both are exact copies (norms)."""
    import torch
    from transformers import AutoModelForCausalLM
    from tests.convert.helpers import tool
    models = {}
    for name, ckpt in (("tp2", runs["ckpt"]), ("tp1", runs["tmp"] / "tp1")):
        (ckpt / "latest").write_text(f"global_step{ITERS}")
        assert tool("checkpoint/export_hf.py", "--load", ckpt, "--output", tmp_path / name) == 0
        models[name] = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
    assert type(models["tp2"]).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {name: m(tokens).logits for name, m in models.items()}
    diff = (logits["tp2"] - logits["tp1"]).abs().max().item()
    print(f"HF logits, TP=2 export vs TP=1 export: max abs difference {diff:.2e}")
    assert diff < 1e-5 * logits["tp1"].abs().max().item() + 1e-6


# ---- the policy (save_load.plan_load) and bad input: no processes

SAVED = {"pp": 2, "dp": 1, "placement": [[0, 1]], "tp": 2}


def _plan(saved, layout, **kw):
    from megatron_ds.training.checkpoint.save_load import plan_load
    return plan_load(saved, layout, **{"finetune": False, "no_load_optim": False, "zero_stage": 1, **kw})


def test_plan_universal_loads_everything_under_any_layout():
    p = _plan(SAVED, {"pp": 1, "dp": 1, "placement": [[0]], "tp": 1}, universal=True)
    assert (p.optimizer, p.progress, p.universal, p.rng) == ("universal", True, True, False)
    assert _plan(SAVED, SAVED, universal=True).rng  # the same layout: every rank's own RNG states
    assert _plan(SAVED, SAVED, universal=True, no_load_optim=True).optimizer is None
    assert not _plan(SAVED, SAVED, universal=True, finetune=True).progress


def test_plan_refuses_another_tp_size_without_universal():
    from megatron_ds.training.checkpoint.save_load import CheckpointError
    with pytest.raises(CheckpointError) as e:
        _plan(SAVED, {**SAVED, "tp": 1}, checkpoint="/ck/global_step3")
    msg = str(e.value)
    assert "--tensor-model-parallel-size 2, this run has 1" in msg and "--universal-checkpoint" in msg
    assert ("python -m megatron_ds.training.checkpoint.universal --input_folder /ck/global_step3 "
            "--output_folder /ck/global_step3_universal") in msg
    assert _plan(SAVED, {**SAVED, "dp": 2}).optimizer == "by_name"  # PP/DP at the same TP: re-cut as before


def _plain_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step3")
    return ckpt


def test_universal_load_of_a_plain_checkpoint_exits_2_naming_the_conversion(tmp_path):
    from tests.training.test_cli import run
    ckpt = _plain_checkpoint(tmp_path)
    rc, err = run("--load", str(ckpt), "--universal-checkpoint")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: --universal-checkpoint: ")
    assert (f"python -m megatron_ds.training.checkpoint.universal --input_folder {ckpt}/global_step3 "
            f"--output_folder {ckpt}/global_step3_universal") in lines[0]


def test_ds_config_key_and_flag(tmp_path, monkeypatch):
    import json
    from megatron_ds.training.config.arguments import ArgumentsError, parse_args
    from tests.training.test_cli import FLAGS
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    ckpt = _plain_checkpoint(tmp_path)
    cfg = tmp_path / "ds.json"

    def parse(key, *flags):
        cfg.write_text(json.dumps({"checkpoint": {"load_universal": key}}))
        return parse_args(FLAGS + ["--deepspeed_config", str(cfg), "--load", str(ckpt), *flags],
                          env={"WORLD_SIZE": "1", "RANK": "0"})

    with pytest.raises(ArgumentsError, match="holds no universal checkpoint"):
        parse(True)  # the key alone asks for it too
    with pytest.raises(ArgumentsError, match='--universal-checkpoint disagrees with ds_config "checkpoint"'):
        parse(False, "--universal-checkpoint")
    (ckpt / "global_step3_universal" / "zero").mkdir(parents=True)
    (ckpt / "global_step3_universal" / "zero" / "optimizer_state.pt").write_bytes(b"")
    (ckpt / "latest_universal").write_text("global_step3_universal")
    args = parse(None, "--universal-checkpoint")
    assert args.universal_checkpoint and args.ds_config["checkpoint"] == {"load_universal": True}
    assert not parse(False).universal_checkpoint


def test_saved_rng_state_holds_the_tensor_parallel_tracker():
    """A resume under the same layout replays the partitioned dropout masks too."""
    import torch
    from megatron_ds.model.tensor_parallel import model_parallel_manual_seed
    from megatron_ds.model.tensor_parallel.rng import Dropout
    from megatron_ds.training.initialize import get_rng_state, set_rng_state
    model_parallel_manual_seed(7, tensor_parallel_rank=1)
    drop = Dropout(0.5, partitioned=True)
    drop(torch.ones(64))  # the tracker's stream moves on
    state = get_rng_state()
    first = drop(torch.ones(256))
    model_parallel_manual_seed(7, tensor_parallel_rank=1)  # a fresh start, as a resumed run has
    set_rng_state(state)
    assert torch.equal(drop(torch.ones(256)), first)


def test_converter_names_a_missing_or_unsafe_step_in_one_line(tmp_path, capsys):
    """The converter stops before DeepSpeed's: exit code 2, one line naming the file and why."""
    from megatron_ds.training.checkpoint.universal import convert
    step = tmp_path / "global_step3"
    out = ["--output_folder", str(tmp_path / "global_step3_universal")]
    assert convert(["--input_folder", str(step), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"python -m megatron_ds.training.checkpoint.universal: error: --input_folder {step} holds no checkpoint "
                   f"step ({step}/mp_rank_00_model_states.pt is missing); give one step folder, SAVE/global_stepN")
    step.mkdir()
    (step / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    assert convert(["--input_folder", str(step), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mp_rank_00_model_states.pt" in err[0]
    assert not (tmp_path / "global_step3_universal").exists()
    import torch
    torch.save({"iteration": 3, "weights": torch.ones(4096)}, step / "whole.pt")  # then cut short, as a full disk does
    (step / "mp_rank_00_model_states.pt").write_bytes((step / "whole.pt").read_bytes()[:8000])
    assert convert(["--input_folder", str(step), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mp_rank_00_model_states.pt cannot be read (" in err[0], err  # torch's reason in it
