"""A small real GPT under every schedule on CPU: tokens/s and memory per rank, against DeepSpeed's 1F1B.

Each schedule runs in its own launch (fresh processes, so the memory figures are its own):
p ranks, ZeRO-1, AdamW, fp32, random tokens; --rounds launches per schedule, every other
round in reverse order; with --tp, every engine at each tensor-parallel size (pp x tp ranks,
data parallel 1). iteration = median wall time of train_batch on rank 0 (after a
barrier) in the best launch (the least disturbed by other work on the machine);
tokens/s = m * micro-batch * sequence * dp / iteration;
peak RSS = the process's high-water mark (ru_maxrss) per rank; train = the highest RSS
sampled every 5 ms during the timed iterations minus the RSS before the first one (what
training holds on top of the model, optimizer and runtime: mostly activations).

On a 2-core machine p=4 ranks are oversubscribed: ranks compete for cores, so a rank's
bubble is partly filled by another rank's work and schedules differ less than on p
devices. The timed-layer bench (bench/schedules.py) measures the schedules themselves.

    python -m bench.gpt_cpu                          # p=4, all schedules, about 30 minutes
    python -m bench.gpt_cpu --engines zbv 1f1b --iterations 3
    python -m bench.gpt_cpu --pp 2 --tp 1 2 --engines zbv   # iteration time at TP=1 and TP=2
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import statistics
import sys
import threading
import time
import warnings

from bench.engines import DUALPIPEV, STOCK, engines
from bench.harness import Machine, Report, alternated, parser, rounds, table
from megatron_ds.testing.launcher import run_ranks

ENGINES = engines()
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class RssSampler:
    """Highest RSS seen every `interval` seconds while running."""

    def __init__(self, interval=0.005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def gpt_config(opts, **extra):
    """The benches' GPTConfig of `opts` (vocab, hidden, layers, heads, seq), `extra` its other fields."""
    from megatron_ds.model import GPTConfig
    return GPTConfig(vocab_size=opts["vocab"], hidden_size=opts["hidden"], num_layers=opts["layers"],
                     num_attention_heads=opts["heads"], max_position_embeddings=opts["seq"], **extra)


def bench_ds_config(opts, pipeline=None, **extra):
    """The benches' ds_config: opts' micro-batch size and count, ZeRO-1, AdamW; `pipeline` its section."""
    config = {"train_micro_batch_size_per_gpu": opts["mbs"], "gradient_accumulation_steps": opts["gas"],
              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, **extra}
    return {**config, "pipeline": dict(pipeline)} if pipeline else config


def random_batches(config, opts, dp_rank=None):
    """batches(step): the step's opts["gas"] micro-batches of random tokens, ((tokens, positions), labels); with
    `dp_rank`, each data-parallel rank its own."""
    import torch
    from megatron_ds.model import position_ids_like

    def batches(step):
        g = torch.Generator().manual_seed(step if dp_rank is None else 1000 * step + dp_rank)
        for _ in range(opts["gas"]):
            tokens = torch.randint(0, config.vocab_size, (opts["mbs"], opts["seq"] + 1), generator=g)
            x = tokens[:, :-1].contiguous()
            yield (x, position_ids_like(x)), tokens[:, 1:].contiguous()
    return batches


def build(name, opts):
    import deepspeed
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from megatron_ds.model import gpt_layer_specs, gpt_loss
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine, topology
    from megatron_ds.pipe.plan.config import ConfigError
    from megatron_ds.schedules import ScheduleError

    config = gpt_config(opts, tensor_model_parallel_size=opts["tp"])
    ds_config = bench_ds_config(opts, ENGINES[name], gradient_clipping=1.0)
    if name == DUALPIPEV:
        if opts["tp"] > 1:
            return config, "DeepSpeed's DualPipeV takes no tensor parallelism here"
        module = DualPipeVModule(layers=gpt_layer_specs(config), loss_fn=gpt_loss, topology=topology(opts["pp"]),
                                 partition_method="type:transformer")
        engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, model_parameters=module.parameters())
        return config, engine
    try:
        module = build_pipeline_module(config, ds_config, opts["pp"], seq_length=opts["seq"])
    except (ConfigError, ScheduleError, NotImplementedError) as exc:
        return config, str(exc).splitlines()[0]
    return config, initialize_engine(module, ds_config, model_parameters=list(module.parameters()))


def worker(name, opts):
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*c10d::broadcast_")  # DeepSpeed's tied-weight broadcast
    torch.set_num_threads(1)
    start = time.perf_counter()
    config, engine = build(name, opts)
    if isinstance(engine, str):
        return {"na": engine}
    init_s = time.perf_counter() - start
    times, losses, every = timed_iterations(engine, random_batches(config, opts), opts)
    return {"times": times, "losses": losses, "init_s": init_s, "memory": every, "dp": engine.dp_world_size}


def timed_iterations(engine, batches, opts, clock=None):
    """opts["warmup"] steps, then opts["iterations"] timed ones (each after a barrier) under `clock` (a
    context manager with .seconds, or None): (times, losses, every rank's {"peak", "train"[, "clock"]} RSS
    bytes and clock seconds)."""
    import torch.distributed as dist
    for step in range(opts["warmup"]):
        engine.train_batch(batches(step))
    before, losses = rss_bytes(), []
    with RssSampler() as sampler, (clock or contextlib.nullcontext()):
        times = alternated({"": lambda step: losses.append(float(engine.train_batch(batches(step))))},
                           opts["iterations"], opts["warmup"])[""]
    mine = {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "train": sampler.peak - before}
    if clock is not None:
        mine["clock"] = clock.seconds
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return times, losses, every


def run_table(args, opts):
    """{(engine, tp): [launch result]}: every engine at every TP size, every other round reversed."""
    runs = {(name, tp): [] for tp in args.tp for name in args.engines}
    for rnd, (name, tp) in rounds(list(runs), args.rounds):  # drifting load hits all alike
        if runs[name, tp] and "na" in runs[name, tp][0]:
            continue
        print(f"round {rnd + 1}: {name} TP={tp} ...", file=sys.stderr, flush=True)
        runs[name, tp].append(run_ranks(args.pp * tp, worker, name, {**opts, "tp": tp}, timeout=1800, quiet=True)[0])
    return runs


def model_opts(args) -> dict:
    """The workers' opts of parsed bench flags: pp, gas, iterations, warmup (0 without the flag) and the model's
    sizes."""
    return dict(pp=args.pp, gas=args.gas, iterations=args.iterations, warmup=getattr(args, "warmup", 0),
                mbs=args.micro_batch_size,
                seq=args.seq_length, hidden=args.hidden_size, layers=args.num_layers, heads=args.num_attention_heads,
                vocab=args.vocab_size)


def main(argv=None):
    ap = parser(__doc__, pp=4, gas=8, micro_batch_size=2, seq_length=256, hidden_size=256, num_layers=8,
                num_attention_heads=8, vocab_size=2048)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes: each engine runs at each, on pp x tp processes")
    ap.add_argument("--rounds", type=int, default=2, help="launches per schedule; the best one counts")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="NAME",
                    help=f"subset of: {', '.join(ENGINES)}")
    args = ap.parse_args(argv)
    if STOCK not in args.engines:
        args.engines.insert(0, STOCK)
    opts, machine, out = model_opts(args), Machine(), Report(args.perf_file, "bench.gpt_cpu", argv)
    procs = args.pp * max(args.tp)
    out(f"# bench/gpt_cpu.py: GPT {opts['layers']} layers, hidden {opts['hidden']}, {opts['heads']} heads, "
        f"seq {opts['seq']}, vocab {opts['vocab']}; p={args.pp}, TP={'/'.join(map(str, args.tp))}, m={args.gas}, "
        f"micro-batch {opts['mbs']}; ZeRO-1 AdamW fp32; median of {args.iterations} iterations after "
        f"{args.warmup} warm-up, best of {args.rounds} launches",
        f"# up to {procs} processes on {machine.cores} CPU cores"
        + (" (oversubscribed: ranks compete for cores)" if procs > machine.cores else "") + f"; {machine.at_start()}")
    runs = run_table(args, opts)
    # A launch's figure is its median iteration; the best launch is the one least disturbed from outside.
    best = {cell: min(statistics.median(r["times"]) for r in rs) for cell, rs in runs.items() if "na" not in rs[0]}
    rows = []
    for (name, tp), rs in runs.items():
        if "na" in rs[0]:
            rows.append([name, tp, f"n/a: {rs[0]['na']}"] + [""] * 7)
            continue
        it, mb, ranks = best[name, tp], 1024 * 1024, range(len(rs[0]["memory"]))
        tokens = args.gas * opts["mbs"] * opts["seq"] * rs[0]["dp"]
        rows.append([name, tp, f"{it:.3f}", " ".join(f"{statistics.median(r['times']):.2f}" for r in rs),
                     f"{tokens / it:.0f}", f"{it / best[STOCK, tp]:.3f}",
                     f"{it / best[name, 1]:.3f}" if (name, 1) in best else "",
                     " ".join(f"{max(r['memory'][k]['peak'] for r in rs) / mb:.0f}" for k in ranks),
                     " ".join(f"{max(r['memory'][k]['train'] for r in rs) / mb:.0f}" for k in ranks),
                     f"{rs[0]['losses'][-1]:.4f}"])
    out("", *table(["schedule", "TP", "iteration (s)", "per launch (s)", "tokens/s",
                     "iteration / DS 1F1B's (lower is better)", "iteration / TP=1's (lower is better)",
                     "peak RSS per rank (MB)", "train RSS per rank (MB)", "loss"], "lrrlrrrllr", rows))
    out("", "# iteration / DS 1F1B's = this iteration / DS 1F1B's (same TP); iteration / TP=1's = this iteration / "
        f"the schedule's at TP=1; memory: the highest over launches; {machine.at_end()}")
    out.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
