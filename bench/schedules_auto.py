"""`"schedule": "auto"` next to the named schedules that fit the same memory budget, on timed layers.

The rows of bench/schedules.py (its model, ds_config and timed layers: 2p TimedLayers, 2 per 1F1B
stage) at m = 2p, for TF:TB:TW = 1:1:1, 1:1:0.5 and 1:1:1 with a heavy last stage (a timed LM head
on the loss stage costing one more stage's F and B: megatron_ds.testing.timed.TimedLoss), and two
budgets per p: p (1F1B's peak activation memory) and p/2 + 1 (ZB-V-Half's). Named schedules (with
Seq1F1B at 2 and 4 even segments, with and without the B/W split, as "auto" weighs it) run when they
fit the larger budget (simulated peak memory, schedules/auto.py's unit), one launch each for every
setting; each auto row is its own launch per setting: it times iterations 1-2 (the start-up
schedule, then its probe of another op size), decides, switches (a rebuild through a checkpoint
when the placement changes), runs one warm-up iteration, then the timed ones.

Columns: iteration = median wall time of train_batch on rank 0 (after a barrier); bubble = measured
from the traces; sim = simulated makespan of the schedule with these costs (per stage, head
included); memory = its simulated peak memory. The summary compares auto with the fastest measured
named schedule that fits the same budget.

    python -m bench.schedules_auto                        # p=4 and p=8, about 25 minutes on 2 cores
    python -m bench.schedules_auto --pp 4 --tf-ms 40 --iterations 3
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import sys

from bench.engines import engines
from bench.harness import Machine, Report, alternated, parser, table
from bench.schedules import HIDDEN, MBS, ROOT, SEQ, ds_config, slug
from megatron_ds.files import write_atomic
from megatron_ds.testing.launcher import run_ranks

# (TF, TB, TW, head) per 1F1B stage, relative to TF; head: the LM head's F and B, in stages
RATIOS = {"1:1:1": (1.0, 1.0, 1.0, 0.0), "1:1:0.5": (1.0, 1.0, 0.5, 0.0), "1:1:1 heavy last": (1.0, 1.0, 1.0, 1.0)}
NAMED = engines(seq_splits=(2, 4), seq_split_method="even")  # timed layers cost a segment its tokens' share
NAMED.pop("DS 1F1B (stock)")
NAMED.pop("DS DualPipeV")
NAMED.update({f"{name} B/W": {**sec, "split_backward": True} for name, sec in NAMED.items()
              if sec["schedule"] == "seq1f1b"})  # the Seq1F1B variants "auto" weighs
WINDOW = (1, 3)  # timed iterations of the auto engine before it switches


def budgets(p):
    return (p // 2 + 1, p)


def auto_name(budget):
    return f"auto budget={budget:g}"


def section(name, p, m):
    if name.startswith("auto"):
        return {"schedule": "auto", "memory_budget": float(name.split("=")[1]), "timers_start_iter": WINDOW[0],
                "timers_end_iter": WINDOW[1], "seq_split_method": "even"}
    return NAMED[name]


# -- worker side ---------------------------------------------------------------------------------------

def set_costs(costs, ratio, tf_ms, p):
    tf, tb, tw, head = RATIOS[ratio]
    per_layer = p / (2 * p) * tf_ms / 1e3  # a 1F1B stage holds 2 of the 2p layers
    costs.tf, costs.tb, costs.tw = tf * per_layer, tb * per_layer, tw * per_layer
    costs.head_f, costs.head_b = head * tf * tf_ms / 1e3, head * tb * tf_ms / 1e3


def worker(p, opts, out_root):
    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron_ds.model import GPTConfig
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.plan.plan import make_plan
    from megatron_ds.testing.timed import TimedCosts, TimedLoss, timed_layer_specs
    from megatron_ds.training.auto_schedule import switch_engine

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    m, name = 2 * p, opts["engine"]
    costs = TimedCosts(seq_length=SEQ, carry_overshoot=True)
    shape = GPTConfig(vocab_size=1, hidden_size=HIDDEN, num_layers=2 * p, num_attention_heads=1,
                      max_position_embeddings=SEQ)

    def build(cfg):
        plan, auto_plan = make_plan(shape, cfg, p, dist.get_world_size() // p)
        module = build_pipeline_module(shape, cfg, p, layers=timed_layer_specs(2 * p, HIDDEN, costs),
                                       loss_fn=TimedLoss(costs), plan=plan)
        return initialize_engine(module, cfg, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3),
                                 auto_plan=auto_plan)

    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(MBS, SEQ, HIDDEN, generator=g),), torch.randn(MBS, SEQ, HIDDEN, generator=g))
            for _ in range(m)]
    results, engine = {}, None
    for ratio in opts["ratios"]:
        set_costs(costs, ratio, opts["tf_ms"], p)
        if engine is None or name.startswith("auto"):
            cfg = ds_config(p, section(name, p, m), None)
            engine = build(cfg)
        decision = None
        if engine.auto is not None:
            reports = []
            engine.on_auto_decision = reports.append
            for _ in range(WINDOW[1]):
                engine.train_batch(iter(data))
            decision = reports[0].decision
            if reports[0].rebuild:
                engine = switch_engine(engine, decision, build)
        for _ in range(opts["warmup"]):
            engine.train_batch(iter(data))
        row = {"steps": [], "trace_dir": os.path.join(out_root, f"p{p}_{slug(ratio)}", slug(name)),
               "schedule": engine.plan.schedule.name, "section": decision["choice"]["section"] if decision else None,
               "decision": decision}
        engine.tracer.trace_dir = row["trace_dir"]
        row["times"] = alternated({name: lambda _, e=engine: e.train_batch(iter(data))}, opts["iterations"],
                                  prepare=lambda _, step, e=engine: row["steps"].append(e.global_steps))[name]
        engine.tracer.trace_dir = None
        results[ratio] = row
    dist.barrier()
    return results if dist.get_rank() == 0 else None


# -- analysis (parent) -------------------------------------------------------------------------------

def sim(sec, p, ratio, tf_ms):
    """(makespan s, peak memory) the simulator gives the schedule of ds_config section `sec`."""
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.schedules.costs import ModelCosts, evaluate
    tf, tb, tw = (x * tf_ms / 1e3 for x in RATIOS[ratio][:3])
    head = RATIOS[ratio][3]
    res = evaluate(pipeline_settings({"pipeline": sec}).build_schedule(p, 2 * p),
                   ModelCosts(tf, tb, tw, head=(head * tf, head * tb, 0.0)))
    return res.makespan, res.peak_memory_max


def analyse(p, runs, tf_ms):
    from megatron_ds.schedules.timeline import load_iteration, measure
    tables = {}
    for ratio in RATIOS:
        rows = {}
        for name, per_ratio in runs.items():
            r = per_ratio.get(ratio)
            if r is None:
                continue
            bubble = statistics.median(measure(load_iteration(r["trace_dir"], s)).bubble_ratio for s in r["steps"])
            sec = r["section"] or NAMED[name]
            makespan, memory = sim(sec, p, ratio, tf_ms)
            it = statistics.median(r["times"])
            rows[name] = {"iteration": it, "bubble": bubble, "sim": makespan, "meas_sim": it / makespan,
                          "memory": memory, "schedule": r["schedule"] if r["section"] is None else
                          " ".join(f"{v}" if k == "schedule" else f"{k}={v}" for k, v in sec.items()),
                          "runner_up": (r["decision"] or {}).get("runner_up")}
        tables[ratio] = rows
    return tables


def markdown(p, ratio, rows, tf_ms):
    tf, tb, tw = (x * tf_ms for x in RATIOS[ratio][:3])
    head = RATIOS[ratio][3]
    return "\n".join([f"**p={p}, m={2 * p}, TF:TB:TW = {ratio}** (TF={tf:g} ms, TB={tb:g} ms, TW={tw:g} ms per 1F1B "
                      "stage" + (f", head F={head * tf:g} ms B={head * tb:g} ms on the loss stage" if head else "")
                      + ")", ""] + table(
        ["schedule", "runs", "iteration (s)", "bubble", "sim. makespan (s)", "measured/sim.", "sim. memory"], "llrrrrr",
        [[name, r["schedule"], f"{r['iteration']:.3f}", f"{r['bubble']:.3f}", f"{r['sim']:.3f}", f"{r['meas_sim']:.3f}",
          f"{r['memory']:g}"] for name, r in rows.items()]))


def summary(p, tables):
    cells, verdicts = [], []
    for ratio, rows in tables.items():
        for budget in budgets(p):
            a = rows.get(auto_name(budget))
            fits = {n: r for n, r in rows.items() if not n.startswith("auto") and r["memory"] <= budget + 1e-9}
            if a is None or not fits:
                continue
            best = min(fits, key=lambda n: fits[n]["iteration"])
            verdicts.append(a["iteration"] / fits[best]["iteration"])
            cells.append([ratio, f"{budget:g}", a["schedule"], f"{a['iteration']:.3f}", best,
                          f"{fits[best]['iteration']:.3f}", f"{verdicts[-1]:.3f}"])
    return "\n".join([f"**p={p}: auto vs the fastest named schedule that fits the same budget (measured)**", ""] + table(
        ["setting", "budget", "auto runs", "auto (s)", "best named that fits", "its time (s)", "auto / best"],
        "lrlrlrr", cells)), verdicts


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--tf-ms", type=float, default=50.0, help="TF of one 1F1B stage, milliseconds")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_schedules_auto"))
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.schedules.auto import peak_memory
    machine, report = Machine(), Report(args.perf_file, "bench.schedules_auto", argv)
    report(f"# bench/schedules_auto.py on {machine.cores} CPU cores, load average {machine.load[0]:.2f} at start; "
           f"TF={args.tf_ms:g} ms per 1F1B stage, {args.iterations} timed iterations (+{args.warmup} warm-up)")
    everything = {}
    for p in args.pp:
        top = max(budgets(p))
        named = [n for n, sec in NAMED.items()
                 if peak_memory(pipeline_settings({"pipeline": sec}).build_schedule(p, 2 * p)) <= top + 1e-9]
        opts = {"tf_ms": args.tf_ms, "iterations": args.iterations, "warmup": args.warmup}
        runs = {}
        for name in named:
            print(f"p={p}: {name}", file=sys.stderr, flush=True)
            runs[name] = run_ranks(p, worker, p, dict(opts, engine=name, ratios=list(RATIOS)),
                                   os.path.join(args.out, f"p{p}"), timeout=args.timeout, quiet=True)[0]
        for budget in budgets(p):
            name = auto_name(budget)
            runs[name] = {}
            for ratio in RATIOS:  # a fresh decision per setting: one launch each
                print(f"p={p}: {name}, {ratio}", file=sys.stderr, flush=True)
                runs[name].update(run_ranks(p, worker, p, dict(opts, engine=name, ratios=[ratio]),
                                            os.path.join(args.out, f"p{p}"), timeout=args.timeout, quiet=True)[0])
        tables = analyse(p, runs, args.tf_ms)
        text, verdicts = summary(p, tables)
        report(*("\n" + markdown(p, ratio, rows, args.tf_ms) for ratio, rows in tables.items()), "\n" + text)
        everything[p] = {"tables": tables, "verdicts": verdicts}
    report(f"\n# {machine.at_end()}")
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "results.json"),
                 json.dumps({"tf_ms": args.tf_ms, "results": everything}, indent=1, default=str))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
