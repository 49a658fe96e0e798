"""Another TP x PP x DP through DeepSpeed's universal checkpoint, end to end (gloo, fp32, LLaMA-style:
GQA, SwiGLU, untied head, so the QKV and gate|up sub-parameter splits are exercised).

One TP=2 x PP=2 run (4 ranks) is both the uninterrupted reference and, saving at iteration 3, the
checkpoint; DeepSpeed's own converter (python -m deepspeed.checkpoint.ds_to_universal) makes the
universal folder; it resumes at PP=2 x DP=2 and at TP=1 x PP=1 (1 rank), the two launches side by
side: iterations 4..8 equal the uninterrupted run's (rel 1e-5), with its consumed samples and lr.
A third resume (TP=1, --no-load-optim) shows the optimizer state is what keeps the losses equal.
The TP=1 run's final checkpoint and the TP=2 run's, exported to Hugging Face (TP shards merged),
give the same logits.
"""
import concurrent.futures
import os
import subprocess
import sys

import pytest

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_resume import launch

SAVE_AT, ITERS = 3, 8
LLAMA = ("--num-layers", "4", "--num-attention-heads", "4", "--num-key-value-heads", "2", "--swiglu",
         "--ffn-hidden-size", "48", "--normalization", "rmsnorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-samples", str(8 * ITERS),
         # the padding of TP=2 for every layout: the padded rows are trained weights in the softmax
         "--pad-vocab-size-to", "50432")


def _convert(step_dir):
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step_dir),
           "--output_folder", f"{step_dir}_universal", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("universal")
    write_corpus(str(tmp / "corpus"))
    ckpt = tmp / "ckpt"
    full, _ = launch(tmp, "tp2_pp2", "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                     "--save-interval", str(SAVE_AT), nproc=4, hard=LLAMA)
    _convert(ckpt / f"global_step{SAVE_AT}")
    assert (ckpt / "latest_universal").read_text() == f"global_step{SAVE_AT}_universal"
    resumes = {"pp2_dp2": dict(nproc=4, extra=()),
               "tp1_pp1": dict(nproc=1, extra=("--pipeline-model-parallel-size", "1", "--save", str(tmp / "tp1"))),
               "tp1_fresh_adam": dict(nproc=1, extra=("--pipeline-model-parallel-size", "1", "--no-load-optim"))}
    with concurrent.futures.ThreadPoolExecutor(len(resumes)) as pool:
        futures = {name: pool.submit(launch, tmp, name, "--load", str(ckpt), "--universal-checkpoint", *r["extra"],
                                     nproc=r["nproc"], hard=LLAMA) for name, r in resumes.items()}
        resumed = {name: f.result() for name, f in futures.items()}
    return dict(full=full, resumed=resumed, ckpt=ckpt, tmp=tmp)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("layout", ["pp2_dp2", "tp1_pp1"])
def test_resume_under_another_layout_continues_the_run(runs, layout):
    full = runs["full"]
    assert [r["iteration"] for r in full] == list(range(1, ITERS + 1))
    records, out = runs["resumed"][layout]
    assert "universal checkpoint, layout" in out and f"at iteration {SAVE_AT}" in out
    assert [r["iteration"] for r in records] == list(range(SAVE_AT + 1, ITERS + 1))  # 5 iterations
    ref = full[SAVE_AT:]
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in ref], rel=1e-12)
    worst = max(abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(records, ref))
    print(f"{layout}: losses {[r['loss'] for r in records]}, uninterrupted {[r['loss'] for r in ref]}: "
          f"largest relative difference {worst:.2e}")
    assert worst < 1e-5, (records, ref)


@pytest.mark.timeout(1800)
def test_no_load_optim_keeps_the_weights_and_starts_adam_afresh(runs):
    """--no-load-optim under --universal-checkpoint: iteration 4's loss (before its step) is the run's,
    the next ones are not: the optimizer state the test above restores is what keeps them equal."""
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
    from tests.checkpoint.helpers import tool
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


# ---- the policy (checkpointing.plan_load) and bad input: no processes

SAVED = {"pp": 2, "dp": 1, "placement": [[0, 1]], "tp": 2}


def _plan(saved, layout, **kw):
    from megatron_ds.training.checkpointing import plan_load
    return plan_load(saved, layout, **{"finetune": False, "no_load_optim": False, "zero_stage": 1, **kw})


def test_plan_universal_loads_everything_under_any_layout():
    p = _plan(SAVED, {"pp": 1, "dp": 1, "placement": [[0]], "tp": 1}, universal=True)
    assert (p.optimizer, p.progress, p.universal, p.rng) == ("universal", True, True, False)
    assert _plan(SAVED, SAVED, universal=True).rng  # the same layout: every rank's own RNG states
    assert _plan(SAVED, SAVED, universal=True, no_load_optim=True).optimizer is None
    assert not _plan(SAVED, SAVED, universal=True, finetune=True).progress


def test_plan_refuses_another_tp_size_without_universal():
    from megatron_ds.training.checkpointing import CheckpointError
    with pytest.raises(CheckpointError) as e:
        _plan(SAVED, {**SAVED, "tp": 1}, checkpoint="/ck/global_step3")
    msg = str(e.value)
    assert "--tensor-model-parallel-size 2, this run has 1" in msg and "--universal-checkpoint" in msg
    assert ("python -m deepspeed.checkpoint.ds_to_universal --input_folder /ck/global_step3 "
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
    assert (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt}/global_step3 "
            f"--output_folder {ckpt}/global_step3_universal") in lines[0]


def test_ds_config_key_and_flag(tmp_path, monkeypatch):
    import json
    from megatron_ds.training.arguments import ArgumentsError, parse_args
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
