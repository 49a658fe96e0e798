"""Save at iteration 4, resume in a fresh launch: iterations 5..8 equal an uninterrupted run bit for bit.

Real processes (2 ranks, PP=2, gloo), with what makes resuming hard switched on:
dropout (RNG states), batch-size ramp-up across the save point, a samples-based
cosine lr with warm-up, and evaluation between steps (the validation iterator's
position). Each of the three runs uses another launcher, so the launchers are
also shown to give the same numbers: srun (emulated: only SLURM_* variables, as
srun sets them), the deepspeed launcher (--local_rank) and torchrun.
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import ForkedScript, child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt2_files():
    from megatron_ds.data.tokenizer import default_gpt2_files
    return default_gpt2_files()


def _srun_like(nproc, cmd, env, cwd, timeout, fork=False):
    """What `srun --ntasks N python pretrain_gpt.py ...` gives each task: SLURM_* variables only. `fork`: each
    task forked from the test launcher's fork server (ForkedScript: its imports done once), its output in a log."""
    env = {k: v for k, v in env.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_NTASKS=str(nproc), SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(free_port()))
    tasks = [dict(env, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) for i in range(nproc)]
    if fork:
        logs = [os.path.join(cwd, f"task{i}_{env['MASTER_PORT']}.log") for i in range(nproc)]
        for log in logs:
            open(log, "w").close()
        procs = [ForkedScript(cmd[1], cmd[2:], task, cwd, log) for task, log in zip(tasks, logs)]
    else:
        procs = [subprocess.Popen(cmd, cwd=cwd, env=task, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for task in tasks]
    outs, rc = [], 0
    try:
        for p in procs:
            if fork:
                p.wait(timeout)
            else:
                outs.append(p.communicate(timeout=timeout)[0])
            rc = rc or p.returncode
    finally:
        for p in procs:
            if p.poll() is None and fork:
                os.killpg(p.pid, signal.SIGKILL)  # the task's own session (ForkedScript's)
            elif p.poll() is None:
                p.kill()
    if fork:
        for log in logs:
            with open(log, errors="replace") as f:
                outs.append(f.read())
    return rc, "".join(outs)


# what makes resuming hard: dropout, a batch-size ramp-up across the save point
HARD = ("--rampup-batch-size", "2", "2", "16", "--train-samples", "36",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1")


def launch(tmp_path, name, *extra, launcher="torchrun", nproc=2, timeout=600, ds_config="ds_config_1f1b_stock.json",
           hard=HARD, entry=None):
    """`entry`: a script run in place of pretrain_gpt.py (which takes the same flags)."""
    vocab, merges = _gpt2_files()
    metrics = tmp_path / f"{name}.jsonl"
    script = [entry or os.path.join(ROOT, "pretrain_gpt.py"),
              "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
              "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", *hard,
              "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-samples", "4",
              "--pipeline-model-parallel-size", "2", "--data-path", str(tmp_path / "corpus"), "--split", "90,10,0",
              "--vocab-file", vocab, "--merge-file", merges, "--make-vocab-size-divisible-by", "128",
              "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
              "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", ds_config)
              if isinstance(ds_config, str) else str(ds_config),
              "--metrics-file", str(metrics), *extra]
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    port = str(free_port())
    if launcher in ("srun", "forked"):  # forked: srun's tasks, each forked from the fork server
        rc, out = _srun_like(nproc, [sys.executable] + script, env, tmp_path, timeout, fork=launcher == "forked")
    else:
        prefix = {"torchrun": ["torch.distributed.run", "--nproc_per_node"],
                  "deepspeed": ["deepspeed.launcher.runner", "--num_gpus"]}[launcher]
        cmd = [sys.executable, "-m", *prefix, str(nproc), "--master_port", port, *script]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, f"{name} ({launcher}) failed (rc {rc}):\n{out[-6000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records, out


def losses_by_iteration(records):
    return {r["iteration"]: r["loss"] for r in records}


def printed_losses(out):
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", out)}


@pytest.mark.timeout(1800)  # three launches; a loaded 2-core CI machine is slow
def test_resume_is_bit_exact(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    ckpt = tmp_path / "ckpt"

    full, full_out = launch(tmp_path, "uninterrupted", launcher="srun")
    assert [r["iteration"] for r in full] == list(range(1, 9))
    assert [r["global_batch_size"] for r in full] == [2, 2, 2, 4, 4, 6, 8, 8]  # the ramp crosses the save

    first, first_out = launch(tmp_path, "first_half", "--save", str(ckpt), "--exit-interval", "4",
                              launcher="deepspeed")
    assert [r["iteration"] for r in first] == [1, 2, 3, 4]
    assert (ckpt / "latest").read_text() == "global_step4"
    assert "successfully saved checkpoint at iteration       4" in first_out

    tb = tmp_path / "tb"
    second, second_out = launch(tmp_path, "resumed", "--load", str(ckpt), "--save", str(ckpt),
                                "--tensorboard-dir", str(tb), "--log-timers-to-tensorboard",
                                "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard")
    assert "successfully loaded checkpoint from" in second_out and "at iteration 4" in second_out
    assert [r["iteration"] for r in second] == [5, 6, 7, 8]

    expected = losses_by_iteration(full)
    got = {**losses_by_iteration(first), **losses_by_iteration(second)}
    assert got == expected, f"losses differ:\n uninterrupted {expected}\n save+resume   {got}"
    # bit-identical floats, and therefore identical Megatron log lines
    assert {**printed_losses(first_out), **printed_losses(second_out)} == printed_losses(full_out)
    assert [r["lr"] for r in first + second] == [r["lr"] for r in full]
    assert (ckpt / "latest").read_text() == "global_step8"
    assert full[-1]["loss"] < full[0]["loss"]
    # TensorBoard (last rank) has Megatron's scalar families, starting where the resumed run starts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list(tb.glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm-loss-training/lm loss", "learning-rate/learning-rate", "grad-norm/grad-norm",
                "batch-size/batch-size", "iteration-time/samples per second", "iteration-time/tokens per second",
                "lm-loss-validation/lm loss validation ppl", "timers/train-step-time"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("lm-loss-training/lm loss")] == [5, 6, 7, 8]
    assert (tb / "loss_curve.png").stat().st_size > 1000


# No dropout (a schedule change moves layers between ranks, and each rank draws its own masks);
# Adam's eps 1e-6: see tests/gpt_harness.optimizer_for (summation-order noise in a zero gradient).
SCHEDULE_CHANGE = ("--num-layers", "4", "--train-samples", "48", "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-eps", "1e-6")


# a mixture of experts with DeepSeek-V3's expert bias (a buffer the checkpoint carries) and the balancing loss
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01",
       "--moe-shared-expert-intermediate-size", "32")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_resume_under_another_schedule(tmp_path, model):
    """Save under zbv, resume under 1f1b, save again and resume under zbv at PP=2 (each way once): the whole
    training state comes back (Adam's moments re-cut by parameter name, the lr schedule, DeepSpeed's step
    count, the data position, a MoE's expert biases), so the losses equal an uninterrupted zbv run: bit-equal
    when measured, rel 1e-5 here because schedules may sum micro-batch gradients in another order."""
    write_corpus(str(tmp_path / "corpus"))
    configs = {}
    for schedule in ("zbv", "1f1b"):
        configs[schedule] = tmp_path / f"{schedule}.json"
        configs[schedule].write_text(json.dumps({"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                                                 "pipeline": {"schedule": schedule}}))
    run = dict(hard=SCHEDULE_CHANGE + model)
    full, _ = launch(tmp_path, "uninterrupted", ds_config=configs["zbv"], **run)
    assert [r["iteration"] for r in full] == list(range(1, 7))
    ckpt = str(tmp_path / "ckpt")
    got, _ = launch(tmp_path, "zbv_1_2", "--save", ckpt, "--exit-interval", "2", ds_config=configs["zbv"], **run)
    for schedule, exit_at in (("1f1b", "4"), ("zbv", "6")):
        part, out = launch(tmp_path, f"{schedule}_to_{exit_at}", "--load", ckpt, "--save", ckpt, "--exit-interval",
                           exit_at, ds_config=configs[schedule], **run)
        assert "the optimizer state re-cut parameter by parameter" in out
        assert f"at iteration {len(got)}" in out
        got += part
    assert [r["iteration"] for r in got] == list(range(1, 7))
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in full]
    assert [r["lr"] for r in got] == [r["lr"] for r in full]
    for mine, ref in zip(got, full):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5), (got, full)
