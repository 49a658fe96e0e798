"""pretrain_gpt.py at TP=2 x PP=2 (4 gloo ranks, ZB-V) gives the per-iteration losses of one process.

Dropout 0: the reference (TP=1, PP=1, stock engine) and the split run see the same
micro-batches in the same order, so every loss agrees to fp32 rounding. Both pad the
vocabulary to the same size (128 x 1 and 64 x TP 2), so the models are the same.
Bad layouts stop at parse time: one line, exit code 2, no process group.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "pretrain_gpt.py")
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
         "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _launch(tmp_path, name, nproc, *extra):
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab, merges = default_gpt2_files()
    metrics = tmp_path / f"{name}.jsonl"
    script = [SCRIPT, *MODEL, "--data-path", str(tmp_path / "corpus"), "--split", "100,0,0",
              "--vocab-file", vocab, "--merge-file", merges, "--log-interval", "1", "--eval-iters", "0",
              "--metrics-file", str(metrics), "--distributed-backend", "gloo", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *script]
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{out[-6000:]}"
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


@pytest.mark.timeout(1800)
def test_tp2_pp2_zbv_equals_one_process(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    ref, _ = _launch(tmp_path, "reference", 1, "--make-vocab-size-divisible-by", "128")
    split, out = _launch(tmp_path, "tp2_pp2", 4, "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
                         "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "ds_config_zbv.json"))
    assert "new size: 50304" in out and "ScheduleEngine, schedule zbv" in out
    # every rank holds a quarter of the model: its TP half of one stage (two ZB-V chunks)
    assert out.count("number of parameters on (tensor, pipeline) model parallel rank") == 4
    assert [r["iteration"] for r in split] == [1, 2, 3, 4] == [r["iteration"] for r in ref]
    print("reference", [r["loss"] for r in ref], "\nTP2xPP2  ", [r["loss"] for r in split])
    for a, b in zip(ref, split):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (ref, split)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (ref, split)
    assert split[-1]["loss"] < split[0]["loss"]


@pytest.mark.parametrize("extra, world, message", [
    (["--tensor-model-parallel-size", "8"], 8,
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8): each rank keeps whole "
     "query heads"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4 must divide the world size 6 (the "
     "data-parallel size is world / (TP x PP))"),
    (["--sequence-parallel"], 2,
     "--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tensor-model-parallel-size "
     "> 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "9"], 2,
     "--sequence-parallel splits each sequence over the 2 tensor-parallel ranks: --seq-length 9 must be a multiple "
     "of --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
      "--seq-length", "12", "--pipe-sp-splits", "4", "--pipe-sp-strategy", "even"], 4,
     "--sequence-parallel splits each Seq1F1B segment over the 2 tensor-parallel ranks"),
])
def test_bad_layout_exits_2_at_once(tmp_path, extra, world, message):
    cmd = [sys.executable, SCRIPT, *MODEL, "--data-path", "corpus", "--vocab-file", __file__, "--merge-file",
           __file__, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=child_env(ROOT, WORLD_SIZE=str(world), RANK="0"))
    elapsed = time.perf_counter() - start
    print(f"exit {proc.returncode} after {elapsed:.2f} s")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: " + message), \
        proc.stderr
    # parse time only (about 1 s idle): torch and a process group would take far longer on a loaded machine
    assert elapsed < 10.0, f"{elapsed:.2f} s"


def test_batch_arithmetic_counts_data_parallel_as_world_over_tp_pp(tmp_path):
    from megatron_ds.training.config.arguments import parse_args
    from megatron_ds.training.config.parallel_args import rank_coordinates
    write_corpus(str(tmp_path / "corpus"))
    args = parse_args([*MODEL, "--data-path", str(tmp_path / "corpus"), "--vocab-file", __file__, "--merge-file",
                       __file__, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                      env={"WORLD_SIZE": "8", "RANK": "0"})
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (2, 2)  # 8 = 2 micro x 2 x DP 2
    assert args.ds_config["train_batch_size"] == 8
    # DeepSpeed's (pipe, data, model) order, model fastest
    assert [rank_coordinates(args, r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_sequence_parallel_refuses_partitioned_stock_activations(tmp_path):
    from megatron_ds.training.config.arguments import ArgumentsError, parse_args
    write_corpus(str(tmp_path / "corpus"))
    (tmp_path / "ds.json").write_text(json.dumps({"pipeline": {"pipe_partitioned": True}}))
    flags = [*MODEL, "--data-path", str(tmp_path / "corpus"), "--vocab-file", __file__, "--merge-file", __file__,
             "--tensor-model-parallel-size", "2", "--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")]
    assert not parse_args(flags, env={"WORLD_SIZE": "2", "RANK": "0"}).sequence_parallel  # fine without SP
    with pytest.raises(ArgumentsError, match="pipe_partitioned = true with --sequence-parallel"):
        parse_args([*flags, "--sequence-parallel"], env={"WORLD_SIZE": "2", "RANK": "0"})
