"""Save at iteration 4, resume in a fresh launch: iterations 5..8 equal an uninterrupted run bit for bit.

Real processes through torchrun (2 ranks, PP=2, gloo), with what makes resuming
hard switched on: dropout (RNG states), batch-size ramp-up across the save point,
a samples-based cosine lr with warm-up, and evaluation between steps (the
validation iterator's position).
"""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.multiproc import _free_port
from tests.training.corpus import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt2_files():
    from megatron_ds.data.tokenizer import default_gpt2_files
    return default_gpt2_files()


def launch(tmp_path, name, *extra, nproc=2, timeout=420):
    vocab, merges = _gpt2_files()
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py"),
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
           "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--rampup-batch-size", "2", "2", "16", "--train-samples", "36",
           "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-samples", "4",
           "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
           "--pipeline-model-parallel-size", "2", "--data-path", str(tmp_path / "corpus"), "--split", "90,10,0",
           "--vocab-file", vocab, "--merge-file", merges, "--make-vocab-size-divisible-by", "128",
           "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
           "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "ds_config_1f1b_stock.json"),
           "--metrics-file", str(metrics), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{out[-6000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records, out


def losses_by_iteration(records):
    return {r["iteration"]: r["loss"] for r in records}


def printed_losses(out):
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", out)}


@pytest.mark.timeout(900)
def test_resume_is_bit_exact(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    ckpt = tmp_path / "ckpt"

    full, full_out = launch(tmp_path, "uninterrupted")
    assert [r["iteration"] for r in full] == list(range(1, 9))
    assert [r["global_batch_size"] for r in full] == [2, 2, 2, 4, 4, 6, 8, 8]  # the ramp crosses the save

    first, first_out = launch(tmp_path, "first_half", "--save", str(ckpt), "--exit-interval", "4")
    assert [r["iteration"] for r in first] == [1, 2, 3, 4]
    assert (ckpt / "latest").read_text() == "global_step4"
    assert "successfully saved checkpoint at iteration       4" in first_out

    second, second_out = launch(tmp_path, "resumed", "--load", str(ckpt), "--save", str(ckpt))
    assert "successfully loaded checkpoint from" in second_out and "at iteration 4" in second_out
    assert [r["iteration"] for r in second] == [5, 6, 7, 8]

    expected = losses_by_iteration(full)
    got = {**losses_by_iteration(first), **losses_by_iteration(second)}
    assert got == expected, f"losses differ:\n uninterrupted {expected}\n save+resume   {got}"
    # bit-identical floats, and therefore identical Megatron log lines
    assert {**printed_losses(first_out), **printed_losses(second_out)} == printed_losses(full_out)
    assert [r["lr"] for r in first + second] == [r["lr"] for r in full]
    assert (ckpt / "latest").read_text() == "global_step8"
    # the loss falls, a TensorBoard-free run still writes its metrics
    assert full[-1]["loss"] < full[0]["loss"]
