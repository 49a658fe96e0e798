"""Every pipeline schedule side by side with DeepSpeed's stock 1F1B and DualPipeV, on timed layers.

The model is 2p TimedLayers (megatron_ds/testing/timed.py): each sleeps its share of TF, TB
and TW per 1F1B stage while real tensors flow and real gloo messages travel, so p ranks on
a 2-core machine behave like p devices with the chosen costs. For each p, every engine (ours
through megatron_ds.pipe.build, DeepSpeed's stock PipelineEngine and its DualPipeVEngine)
gets its own launch and runs every setting, one engine after another: one engine per
process, as in training. (--one-launch builds them all in one launch and cycles through them
iteration by iteration, so machine noise hits all alike; but every engine's process groups
bring gloo threads that poll, and with all 11 engines at p=8 - 60 groups a rank - their
wake-ups kept 40 % of this 2-core machine busy and slowed every message.) Every timed
iteration is traced ("pipeline.trace_dir").

Columns: iteration = median wall time of train_batch on rank 0 (after a barrier);
bubble = measured bubble ratio from the traces (max over ranks of idle / compute makespan,
median over iterations); sim = makespan the simulator predicts for the same costs
(megatron_ds.schedules.simulate; DeepSpeed's engines by replaying their instruction
streams, bench/ds_replay.py); meas/sim = iteration / sim; vs DS = iteration / DeepSpeed
1F1B's. A schedule the engine refuses shows "n/a" and the reason.

    python -m bench.schedules                        # p=4 and p=8, about 30 minutes
    python -m bench.schedules --pp 4 --iterations 3 --tf-ms 40 --pictures docs/perf
"""
from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import sys
import time

from bench.engines import DUALPIPEV, STOCK, engines, unsupported
from bench.harness import Machine, Report, alternated, parser, table as table_lines
from megatron_ds.files import write_atomic
from megatron_ds.testing.launcher import run_ranks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))

HIDDEN, MBS, SEQ = 64, 2, 16
RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1:0.5": (1.0, 1.0, 0.5)}
# timed layers cost a segment its share of the tokens: even splits
ENGINES = engines(seq_splits=(2, 4), seq_split_method="even")


def settings(p, opts=None):
    """(m, ratio) pairs: m = p and 2p unless opts["micro_batches"] names them, every ratio unless opts["ratios"]."""
    opts = opts or {}
    return [(m, ratio) for m in (opts.get("micro_batches") or (p, 2 * p)) for ratio in (opts.get("ratios") or RATIOS)]


def slug(name):
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def setting_key(p, m, ratio):
    return f"p{p}_m{m}_{ratio.replace(':', '-')}"


# -- worker side (one process per pipeline rank) -------------------------------------------------

def ds_config(p, pipeline, trace_dir, m=None):
    """The timed-layer benches' ds_config: MBS-sequence micro-batches, m of them (default 2p), ZeRO-1, SGD
    (the engine's), the `pipeline` section cut uniformly."""
    section = dict(pipeline or {}, partition_method="uniform", trace_dir=trace_dir)
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": m or 2 * p,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9, "pipeline": section}


def build_engine(name, p, costs, trace_dir):
    """(engine, None) or (None, reason it cannot run)."""
    import deepspeed
    import torch
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from megatron_ds.model import GPTConfig
    from megatron_ds.testing.timed import timed_layer_specs, timed_loss
    from megatron_ds.pipe.build import build_pipeline_module, deepspeed_engine_class, initialize_engine, topology
    from megatron_ds.pipe.plan.config import ConfigError
    from megatron_ds.pipe.trace import TracedDualPipeVEngine, Tracer
    from megatron_ds.schedules import ScheduleError

    layers = 2 * p
    specs = timed_layer_specs(layers, HIDDEN, costs)
    cfg = ds_config(p, ENGINES[name], trace_dir)
    if name == DUALPIPEV:
        module = DualPipeVModule(layers=specs, loss_fn=timed_loss, topology=topology(p), partition_method="uniform")
        traced = functools.partial(TracedDualPipeVEngine, tracer=Tracer(trace_dir))
        with deepspeed_engine_class("DualPipeVEngine", traced):
            engine, _, _, _ = deepspeed.initialize(model=module, config=cfg,
                                                   optimizer=torch.optim.SGD(module.parameters(), lr=1e-3))
        return engine, None
    shape = GPTConfig(vocab_size=1, hidden_size=HIDDEN, num_layers=layers, num_attention_heads=1,
                      max_position_embeddings=SEQ)
    try:
        module = build_pipeline_module(shape, cfg, p, layers=specs, loss_fn=timed_loss)
    except (ConfigError, ScheduleError, NotImplementedError) as exc:
        return None, str(exc).splitlines()[0]
    return initialize_engine(module, cfg, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3)), None


def worker(p, opts, out_root):
    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron_ds.testing.timed import TimedCosts

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    costs = TimedCosts(seq_length=SEQ, carry_overshoot=True)  # a segment costs its share
    built, results = {}, {"na": {}, "settings": {}, "init_s": {}}
    for name in opts["engines"]:
        start = time.perf_counter()
        engine, reason = build_engine(name, p, costs, os.path.join(out_root, "unused"))
        results["init_s"][name] = time.perf_counter() - start
        if engine is None:
            results["na"][name] = reason
        else:
            engine.tracer.trace_dir = None
            built[name] = engine
    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(MBS, SEQ, HIDDEN, generator=g),), torch.randn(MBS, SEQ, HIDDEN, generator=g))
            for _ in range(2 * p)]
    per_layer = p / (2 * p) * opts["tf_ms"] / 1e3  # a 1F1B stage holds 2 of the 2p layers
    for m, ratio in settings(p, opts):
        key = setting_key(p, m, ratio)
        costs.tf, costs.tb, costs.tw = (x * per_layer for x in RATIOS[ratio])
        live = {n: e for n, e in built.items() if not unsupported(n, p, m)}
        for e in live.values():
            e.set_train_batch_size(MBS * m * e.dp_world_size)
            e.tracer.trace_dir = None
        t0 = time.perf_counter()
        for _ in range(opts["warmup"]):
            for e in live.values():
                e.train_batch(iter(data[:m]))
        rows = {n: {"steps": [], "trace_dir": os.path.join(out_root, key, slug(n))} for n in live}

        def trace(name, step):  # off the clock: only the engine about to run traces
            for n, e in live.items():
                e.tracer.trace_dir = rows[n]["trace_dir"] if n == name else None
            rows[name]["steps"].append(live[name].global_steps)
        times = alternated({n: lambda _, e=e: e.train_batch(iter(data[:m])) for n, e in live.items()},
                           opts["iterations"], swap=False, prepare=trace)
        for n, e in live.items():
            rows[n]["times"], e.tracer.trace_dir = times[n], None
        results["settings"][key] = {"p": p, "m": m, "ratio": ratio, "rows": rows}
        if rank == 0:
            print(f"  {key}: {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr,
                  flush=True)
    dist.barrier()
    return results if rank == 0 else None


def merge(results, part):
    """Fold one launch's worker results into `results`."""
    results["na"].update(part["na"])
    results["init_s"].update(part["init_s"])
    for key, st in part["settings"].items():
        into = results["settings"].setdefault(key, dict(st, rows={}))
        into["rows"].update(st["rows"])


# -- analysis (parent) ----------------------------------------------------------------------------

def simulated(name, p, m, tf, tb, tw):
    """(makespan, bubble ratio) the simulator predicts for `name` with these stage costs."""
    from bench.ds_replay import replay
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.schedules import simulate
    if name in (STOCK, DUALPIPEV):
        makespan = replay("1f1b" if name == STOCK else "dualpipev", p, m, tf, tb, tw)
        return makespan, 1.0 - m * (tf + tb + tw) / makespan  # every rank does m stages of work
    sched = pipeline_settings({"pipeline": ENGINES[name]}).build_schedule(p, m)
    result = simulate(sched, tf, tb, tw)
    return result.makespan, result.bubble_ratio


def analyse(results, opts):
    from megatron_ds.schedules.timeline import load_iteration, measure
    tables = {}
    for key, st in results["settings"].items():
        p, m, ratio = st["p"], st["m"], st["ratio"]
        tf, tb, tw = (x * opts["tf_ms"] / 1e3 for x in RATIOS[ratio])
        rows = {}
        for name in opts["engines"]:
            if name in results["na"]:
                rows[name] = {"na": results["na"][name]}
                continue
            if unsupported(name, p, m):
                rows[name] = {"na": unsupported(name, p, m)}
                continue
            r = st["rows"][name]
            bubbles, computes, spans = [], [], []
            for step in r["steps"]:
                measured = measure(load_iteration(r["trace_dir"], step))
                bubbles.append(measured.bubble_ratio)
                computes.append(measured.makespan)
                spans.append(measured.span)
            sim, sim_bubble = simulated(name, p, m, tf, tb, tw)
            it = statistics.median(r["times"])
            median_step = r["steps"][sorted(range(len(r["times"])), key=r["times"].__getitem__)[len(r["times"]) // 2]]
            rows[name] = {"iteration": it, "bubble": statistics.median(bubbles), "compute": statistics.median(computes),
                          "traced": statistics.median(spans),
                          "sim": sim, "sim_bubble": sim_bubble, "meas_sim": it / sim, "times": r["times"],
                          "trace_dir": r["trace_dir"], "median_step": median_step}
        base = rows.get(STOCK, {}).get("iteration")
        for row in rows.values():
            if "iteration" in row and base:
                row["vs_stock"] = row["iteration"] / base
        tables[key] = {"p": p, "m": m, "ratio": ratio, "rows": rows}
    return tables


def markdown(table, tf_ms):
    t = table
    tf, tb, tw = (x * tf_ms for x in RATIOS[t["ratio"]])
    rows = [[name, f"n/a: {r['na']}"] + [""] * 5 if "na" in r else
            [name, f"{r['iteration']:.3f}", f"{r['bubble']:.3f}", f"{r['sim']:.3f}", f"{r['sim_bubble']:.3f}",
             f"{r['meas_sim']:.3f}", f"{r['vs_stock']:.3f}" if "vs_stock" in r else "-"] for name, r in t["rows"].items()]
    return "\n".join([f"**p={t['p']}, m={t['m']}, TF:TB:TW = {t['ratio']}** (TF={tf:g} ms, TB={tb:g} ms, "
                      f"TW={tw:g} ms per 1F1B stage)", ""] + table_lines(
        ["schedule", "iteration (s)", "bubble", "sim. makespan (s)", "sim. bubble", "measured/sim.", "vs DS 1F1B"],
        "lrrrrrr", rows))


def summary(tables, column="vs_stock", title="iteration / DS 1F1B's"):
    """One row per engine, one column per setting: `column` of every table, side by side."""
    keys = list(tables)
    names = list(dict.fromkeys(n for t in tables.values() for n in t["rows"]))
    head = [f"p={tables[k]['p']} m={tables[k]['m']} {tables[k]['ratio']}" for k in keys]
    cells = [[tables[k]["rows"].get(name, {}).get(column) for k in keys] for name in names]
    return "\n".join([f"**{title}**", ""] + table_lines(["schedule", *head], "l" + "r" * len(keys), [
        [name, *("n/a" if c is None else f"{c:.3f}" for c in row)] for name, row in zip(names, cells)]))


DUALPIPEV_CLAIM = 0.946  # our DualPipeV's iteration must stay below this fraction of DeepSpeed 1F1B's


def claims(tables):
    """One line per setting: our dualpipev's iteration over DeepSpeed 1F1B's, measured in the same run."""
    lines = []
    for key, t in tables.items():
        ours, base = t["rows"].get("dualpipev", {}), t["rows"].get(STOCK, {}).get("iteration")
        if "iteration" in ours and base:
            ratio = ours["iteration"] / base
            lines.append(f"{key}: dualpipev / DS 1F1B = {ratio:.3f} ({'<' if ratio < DUALPIPEV_CLAIM else 'NOT <'} "
                         f"{DUALPIPEV_CLAIM})")
    return lines


def pictures(tables, key, out_dir, tf_ms):
    """Measured-over-simulated timeline of every engine at one setting."""
    from megatron_ds.schedules import simulate
    from megatron_ds.schedules.render import plot_measured
    from megatron_ds.schedules.timeline import load_iteration, to_schedule
    t = tables[key]
    tf, tb, tw = (x * tf_ms / 1e3 for x in RATIOS[t["ratio"]])
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, r in t["rows"].items():
        if "na" in r:
            continue
        traces = load_iteration(r["trace_dir"], r["median_step"])
        sim = simulate(to_schedule(traces), tf, tb, tw)
        path = os.path.join(out_dir, f"{key}_{slug(name)}.png")
        plot_measured(traces, sim, path, title=f"{name}, p={t['p']} m={t['m']} TF:TB:TW={t['ratio']}: measured "
                                      f"iteration {r['iteration'] * 1e3:.0f} ms, bubble {r['bubble']:.3f}")
        written.append(path)
    return written


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--tf-ms", type=float, default=100.0, help="TF of one 1F1B stage, milliseconds")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=None, help="default: p and 2p")
    ap.add_argument("--ratios", nargs="+", default=None, choices=list(RATIOS), help="TF:TB:TW settings (default all)")
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per engine and setting")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per engine and setting")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="NAME",
                    help=f"subset of: {', '.join(ENGINES)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_schedules"),
                    help="traces and results.json go here")
    ap.add_argument("--pictures", help="draw measured vs simulated timelines of --picture-setting into this folder")
    ap.add_argument("--picture-setting", default="p4_m8_1-1-1")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per launch")
    ap.add_argument("--one-launch", action="store_true",
                    help="all engines in one launch per p, alternating iteration by iteration")
    args = ap.parse_args(argv)
    if STOCK not in args.engines:
        args.engines.insert(0, STOCK)
    opts = {"tf_ms": args.tf_ms, "iterations": args.iterations, "warmup": args.warmup, "engines": args.engines,
            "micro_batches": args.micro_batches, "ratios": args.ratios}
    machine, report = Machine(), Report(args.perf_file, "bench.schedules", argv)
    report(f"# bench/schedules.py on {machine.cores} CPU cores, {machine.at_start()}; TF={args.tf_ms:g} ms per "
           f"1F1B stage, {args.iterations} timed iterations (+{args.warmup} warm-up) per engine and setting")
    tables = {}
    for p in args.pp:
        print(f"p={p}: launching {p} ranks", file=sys.stderr, flush=True)
        out = os.path.join(args.out, f"p{p}")
        if args.one_launch:
            results = run_ranks(p, worker, p, opts, out, timeout=args.timeout, quiet=True)[0]
        else:
            results = {"na": {}, "settings": {}, "init_s": {}}
            for name in args.engines:
                print(f"  {name}", file=sys.stderr, flush=True)
                merge(results, run_ranks(p, worker, p, dict(opts, engines=[name]), out, timeout=args.timeout,
                                         quiet=True)[0])
        tables.update(analyse(results, opts))
        report(*("\n" + markdown(table, args.tf_ms) for table in tables.values() if table["p"] == p))
    report("\n" + summary(tables) + "\n\n" + summary(tables, "meas_sim", "measured / simulated makespan"),
           *claims(tables), f"\n# {machine.at_end()}")
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "results.json"), json.dumps(
        {"tf_ms": args.tf_ms, "load_start": machine.load, "load_end": os.getloadavg(), "tables": tables}, indent=1))
    if args.pictures and args.picture_setting in tables:
        report(*(f"wrote {path}" for path in pictures(tables, args.picture_setting, args.pictures, args.tf_ms)))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
