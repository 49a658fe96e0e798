"""The saving iteration's stall, synchronous against --async-save, on CPU, with a GPT of 100M+ parameters.

Each mode is one launch of pretrain_gpt.py (torchrun, PP ranks, 1F1B, ZeRO-1, fp32, a random corpus) that
saves once mid-run (--save-at) and at the end, into a fresh folder under --workdir; --rounds launches of each
mode alternate their order, and the table keeps each mode's least disturbed round (the smallest `step`), as
bench/gpt_cpu.py does. Two layouts by default (--pp 2 1): PP 2 puts two ranks on a 2-core machine, so the
writers have no core of their own; PP 1 is one rank, whose writer may use the core training leaves idle, as
on a GPU node, where the host cores idle while the device computes. Parameters are summed over the ranks (the tied embedding counted on both stages). From
the run's metrics
file (each iteration's train_batch time) and its save line:

- step: the median train_batch time of the iterations before the save (after the first);
- stopped: the time training stopped for the save (the whole save, or the host copy under --async-save);
- after: the time of the iterations after the save over `step`, summed (signed; under --async-save the
  writers compete with training for cores and memory bandwidth, a synchronous save's should be near 0);
- stall = stopped + after: what the save cost the run;
- write MB/s: rank 0's file bytes over its write time, against a plain fsynced sequential write of
  --probe-mib MiB into the same folder (save_stats.probe), measured by the bench right after each launch:
  the run's own probe (--save-write-probe-mib) is off, since under --async-save it would run on the writer
  thread inside the `after` window, a synchronous run's before its timed save.

    python -m bench.async_save                       # GPT-2 small shape (124M), PP 2 and PP 1, ~20 minutes on 2 cores
    python -m bench.async_save --num-layers 2 --hidden-size 64 --iterations 6 --save-at 3   # a toy, seconds
    python -m bench.async_save --writer-mb 480        # the writers alone, in one process, no launch

--writer-mb: torch.save (plus the manifest's read of the file, as the background writer did before) against
zip_writer (the writer now), each on a thread of one process while its main thread runs small matmuls as a
training thread would, alternated --rounds times (at least 3): the median write time, the share of its
alone rate the training thread kept meanwhile, and the training time lost = (1 - share) x write time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench.options import add_model_args
from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.checkpoint import save_stats
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"checkpoint at iteration (\d+): training stopped (\d+\.\d+) s.*?per rank 0: (\d+\.\d) MB in "
                  r"(\d+\.\d+) s = (\d+\.\d) MB/s(?: \((\d+\.\d+)x the plain sequential write's (\d+\.\d) MB/s\))?")
PARAMS = re.compile(r"number of parameters on .*?: (\d+)")


def launch(args, workdir, mode, pp):
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab, merges = default_gpt2_files()
    ckpt, metrics = os.path.join(workdir, f"ckpt_{mode}"), os.path.join(workdir, f"{mode}.jsonl")
    ds_config = os.path.join(workdir, "ds_config.json")
    with open(ds_config, "w") as f:
        json.dump({"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": {"schedule": "1f1b"}}, f)
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.gas),
             "--train-iters", str(args.iterations), "--lr", "1e-4", "--pipeline-model-parallel-size", str(pp),
             "--data-path", os.path.join(workdir, "corpus"), "--split", "100,0,0", "--vocab-file", vocab,
             "--merge-file", merges, "--log-interval", "1", "--eval-iters", "0", "--save", ckpt,
             "--save-interval", str(args.save_at), "--save-write-probe-mib", "0",
             "--metrics-file", metrics, "--deepspeed", "--deepspeed_config", ds_config]
    if mode == "async":
        flags.append("--async-save")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(pp), "--master_port",
           str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    proc = subprocess.run(cmd, cwd=workdir, env=child_env(ROOT, OMP_NUM_THREADS=str(args.threads)),
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{mode} run failed (rc {proc.returncode}):\n{out[-4000:]}")
    with open(metrics) as f:
        times = {r["iteration"]: r["time_s"] for r in map(json.loads, f)}
    saves = {int(m.group(1)): m for m in LINE.finditer(out)}
    probe = save_stats.probe(ckpt, args.probe_mib, 0)
    shutil.rmtree(ckpt, ignore_errors=True)
    return times, saves[args.save_at], sum(int(n) for n in PARAMS.findall(out)), probe


def measure(times, save, save_at, probe):
    before = [times[i] for i in range(2, save_at + 1)]  # the first iteration warms up; the saving one's step is
    step = statistics.median(before)                    # before its save
    stopped = float(save.group(2))
    after = sum(times[i] - step for i in range(save_at + 1, max(times) + 1))  # signed: noise cancels
    mbs = float(save.group(5))
    return {"step": step, "stopped": stopped, "after": after, "stall": stopped + after, "mb": float(save.group(3)),
            "mbs": mbs, "probe": probe}


def table(rows, params, pp):
    lines = [f"PP {pp}: {pp} rank(s); GPT of {params / 1e6:.1f}M parameters; stall = stopped + after (seconds), "
             "rank 0's write",
             f"{'mode':6} {'step':>7} {'stopped':>8} {'after':>7} {'stall':>7} {'MB':>8} {'MB/s':>7} "
             f"{'plain MB/s':>10} {'ratio':>6}"]
    for mode, r in rows.items():
        probe = f"{r['probe']:10.1f} {r['mbs'] / r['probe']:6.2f}" if r["probe"] else f"{'-':>10} {'-':>6}"
        lines.append(f"{mode:6} {r['step']:7.2f} {r['stopped']:8.3f} {r['after']:7.2f} {r['stall']:7.2f} "
                     f"{r['mb']:8.1f} {r['mbs']:7.1f} {probe}")
    if rows.get("sync") and rows.get("async") and rows["sync"]["stall"] > 0:
        lines.append(f"async stall / sync stall: {rows['async']['stall'] / rows['sync']['stall']:.3f}")
    return "\n".join(lines)


def lost(seconds, kept):
    """Training time a write cost: the write's duration times the share of the training rate it took."""
    return (1.0 - kept) * seconds


def writer_cost(mb, rounds, path):
    """{writer: (median write s, median share of the training rate kept)} (see --writer-mb)."""
    import threading
    import time

    import torch

    from megatron_ds.training.checkpoint import engine
    from megatron_ds.training.checkpoint.manifest import entry
    from megatron_ds.training.faults import disk_full
    state = {"t": [torch.randn(1 << 20) for _ in range(max(1, mb * 10 ** 6 // (4 << 20)))]}
    writers = {"torch.save": lambda: (disk_full.write_torch(state, path), entry(path)),
               "zip_writer": lambda: engine.write_background(state, path, True)}
    a = torch.randn(128, 128)

    def train(alive):
        n, start = 0, time.perf_counter()
        while alive():
            a @ a
            n += 1
        return n / (time.perf_counter() - start), time.perf_counter() - start

    end = time.perf_counter() + 2
    alone = train(lambda: time.perf_counter() < end)[0]
    found = {name: [] for name in writers}
    for _ in range(max(3, rounds)):
        for name, write in writers.items():
            thread = threading.Thread(target=write)
            thread.start()
            rate, seconds = train(thread.is_alive)
            thread.join()
            found[name].append((seconds, rate / alone))
            os.remove(path)
    return {name: (statistics.median(s for s, _ in rows), statistics.median(k for _, k in rows))
            for name, rows in found.items()}


def writer_table(costs, mb):
    lines = [f"{mb} MB written on a thread beside a training thread (medians)",
             f"{'writer':11} {'write s':>8} {'kept':>6} {'lost s':>7}"]
    for name, (seconds, kept) in costs.items():
        lines.append(f"{name:11} {seconds:8.2f} {kept:6.2f} {lost(seconds, kept):7.2f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 1], help="pipeline sizes (layouts), one table each")
    add_model_args(p, gas=2, micro_batch_size=1, seq_length=64, hidden_size=768, num_layers=12,
                   num_attention_heads=12)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--save-at", type=int, default=5, help="the mid-run save's iteration")
    p.add_argument("--probe-mib", type=int, default=256, help="the plain write measured after each launch")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--rounds", type=int, default=1, help="launches of each mode, in alternating order")
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--workdir", default=None, help="default: a temporary folder, removed after")
    p.add_argument("--writer-mb", type=int, default=0, help="measure the writers alone on this many MB, no launch")
    args = p.parse_args(argv)
    if args.writer_mb:
        with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
            costs = writer_cost(args.writer_mb, args.rounds, os.path.join(workdir, "state.pt"))
        print(writer_table(costs, args.writer_mb))
        return costs
    if not 2 <= args.save_at < args.iterations - 1:
        p.error("--save-at must leave an iteration before it (after the first) and two after it")
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        write_corpus(os.path.join(workdir, "corpus"))
        rows, params = {pp: {} for pp in args.pp}, {}
        for pp in args.pp:
            for n in range(args.rounds):
                for mode in args.modes if n % 2 == 0 else reversed(args.modes):
                    times, save, params[pp], probe = launch(args, workdir, mode, pp)
                    row = measure(times, save, args.save_at, probe)
                    if mode not in rows[pp] or row["step"] < rows[pp][mode]["step"]:
                        rows[pp][mode] = row
    print("\n\n".join(table(rows[pp], params[pp], pp) for pp in args.pp))
    return rows


if __name__ == "__main__":
    main()
