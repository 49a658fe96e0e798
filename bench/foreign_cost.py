"""What megatron_ds.initialize costs on a user's own PipelineModule: a Linear/Tanh stack on CPU.

Two comparisons, in one launch of p gloo ranks (one thread each):
- our engine under 1f1b against DeepSpeed's stock PipelineEngine on the same module and data, the two engines
  built side by side in each process and their iterations alternated (the order swapped every iteration), so
  machine noise hits both alike: median train_batch wall time (rank 0, after a barrier) and their ratio, the
  median of the ratios of neighbouring iterations (slow drifts of the machine's load cancel), and each rank's
  CPU time per iteration (what the process itself spends, which waiting for a core on a loaded machine does
  not inflate);
- zbv and dualpipev (the B/W split through autograd) against the simulator: every other iteration is traced
  (traced and untraced ones interleave, so a drift of the machine's load hits both alike). Each traced one
  gives each op kind's median time (schedules.timeline.median_costs: TF, TB, TW and BW of one 1F1B stage), the
  runtime's own time per op (between two compute ops, outside the receive waits: the instruction's dispatch and
  what an op does before its input has come, the median per op kind) and the messages' latency
  (schedules.measurement.message_latencies), as "auto" measures them (pipe/auto.py). The simulator
  (megatron_ds.schedules.simulate, on the op order the ranks ran; a fused BW op at its own time) turns them into
  a makespan, to which the prediction adds what the traces hold outside the compute ops (data before the first
  op, the optimizer step after the last). meas/sim: the median untraced iteration over the median prediction;
  paired: the median of each untraced iteration over the prediction of the traced one just before it; "op
  times only": without the runtime's time per op and the latency. Our 1f1b is traced and simulated alike as the
  control. The machine's other load: per iteration, the CPU time of every process (/proc/stat) less the ranks'
  own, in cores; "quiet half": the paired ratio over the untraced iterations with the least of it. The engines
  of this part are timed in alternation too; each iteration's batches are drawn before its clock starts.

    python -m bench.foreign_cost                       # p=2, about a minute on 2 idle cores
    python -m bench.foreign_cost --pp 4 --gas 8 --width 256
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench.harness import Machine, alternated, emit, paired_ratio, parser, table
from megatron_ds.testing.launcher import run_ranks

SPLIT = ["1f1b", "zbv", "dualpipev"]  # 1f1b: the control, whose measured/simulated ratio is the machine's


def user_module(pp, width, layers, seed=1234):
    """A Linear/Tanh stack as a user writes it: LayerSpecs, MSE loss, DeepSpeed's default cut."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    torch.manual_seed(seed)
    specs = []
    for _ in range(layers):
        specs += [LayerSpec(torch.nn.Linear, width, width), torch.nn.Tanh()]
    return PipelineModule(layers=specs, num_stages=pp, loss_fn=torch.nn.MSELoss(), partition_method="parameters")


def ds_config(args, schedule=None, trace_dir=None):
    config = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.gas,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    if schedule:
        config["pipeline"] = {"schedule": schedule, **({"trace_dir": trace_dir} if trace_dir else {})}
    return config


def batches(args, step):
    import torch
    g = torch.Generator().manual_seed(step)
    return iter([(torch.randn(args.mbs, args.width, generator=g), torch.randn(args.mbs, args.width, generator=g))
                 for _ in range(args.gas)])


def machine_cpu():
    """CPU seconds every process of this machine has spent so far (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def timed(engines, args, iterations, start_step=0, cpu=None, trace_dirs=None, machine=None):
    """{name: [wall seconds of train_batch]}, the engines alternated, their order swapped every iteration;
    `cpu` (a dict) gets the process's CPU seconds of each (its threads', gloo's included); with `trace_dirs`
    ({name: dir}) every other iteration is traced (the first of them), and `machine` (a dict) gets per
    iteration (traced step or None, the machine's CPU seconds in it or None)."""

    def prepare(name, step):  # off the clock: the trace switched, the batches drawn
        engine, traced = engines[name], trace_dirs is not None and (step - start_step) % 2 == 0
        if trace_dirs is not None:
            engine.tracer.trace_dir = trace_dirs[name] if traced else None
        return name, engine.global_steps if traced else None, batches(args, step)

    def run(prepared):
        name, traced_step, data = prepared
        start_cpu, start_machine = time.process_time(), machine_cpu()
        engines[name].train_batch(data)
        if cpu is not None:
            cpu.setdefault(name, []).append(time.process_time() - start_cpu)
        if machine is not None:
            end_machine = machine_cpu()
            used = None if start_machine is None or end_machine is None else end_machine - start_machine
            machine.setdefault(name, []).append((traced_step, used))
    return alternated({name: run for name in engines}, iterations, start_step, prepare=prepare)


def _gaps(traces):
    """{kind: the median time the runtime spends per op before it}: between two compute ops of a rank, less
    the receive waits and other instructions within (auto's gap, pipe/auto.py, by the kind that follows)."""
    per = {}
    for t in traces:
        compute = t.of("compute")
        others = [e for e in t.events if e["cat"] != "compute"]
        for a, b in zip(compute, compute[1:]):
            lo, hi = a["ts"] + a["dur"], b["ts"]
            inside = sum(max(0.0, min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])) for e in others)
            per.setdefault(b["args"]["kind"], []).append(max(0.0, hi - lo - inside))
    return {kind: statistics.median(v) for kind, v in per.items()}


def _timed_ops(traces):
    """{op: (start, end, start of the receive wait it ended, or None)}, as measurement.message_latencies takes
    them (a compute event that waited starts where its wait ends)."""
    from megatron_ds.schedules.timeline import op_of
    out = {}
    for t in traces:
        waits = {round((e["ts"] + e["dur"]) * 1e6): e["ts"] for e in t.of("p2p") if e["name"].startswith("recv")}
        for e in t.of("compute"):
            out[op_of(e)] = (e["ts"], e["ts"] + e["dur"], waits.get(round(e["ts"] * 1e6)))
    return out


def predicted(trace_dir):
    """{step: the simulator's iteration for that traced step of `trace_dir`}, each a dict: costs (median op
    times), gaps (the runtime's time per op), p2p (message latency), sim (makespan of the op times alone), full
    (makespan with the gaps and the latency), outside (the traced time outside the compute ops)."""
    from megatron_ds.schedules import measurement, simulate
    from megatron_ds.schedules.timeline import load_iteration, measure, median_costs, steps, to_schedule
    out = {}
    for step in steps(trace_dir):
        traces = load_iteration(trace_dir, step)
        costs, gaps, got, schedule = median_costs(traces), _gaps(traces), measure(traces), to_schedule(traces)
        tb, tw = costs.get("B", costs.get("BW", 0.0) / 2), costs.get("W", costs.get("BW", 0.0) / 2)
        tbw = costs.get("BW")  # dualpipev's fused ops cost less than its split B + W (autograd_split's calls)
        overhead = (gaps.get("F", 0.0), gaps.get("B", gaps.get("BW", 0.0) / 2),
                    gaps.get("W", gaps.get("BW", 0.0) / 2))  # a BW op pays B's and W's
        latencies = measurement.message_latencies(schedule, _timed_ops(traces))
        p2p = max(0.0, statistics.median(latencies)) if latencies else 0.0
        out[step] = {"costs": costs, "gaps": gaps, "p2p": p2p, "outside": got.span - got.makespan,
                     "sim": simulate(schedule, costs.get("F"), tb, tw, tbw=tbw).makespan,
                     "full": simulate(schedule, costs.get("F"), tb, tw, tbw=tbw, op_overhead=overhead,
                                      p2p_latency=p2p).makespan}
    return out


def rank_main(args, trace_root):
    import deepspeed
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    import megatron_ds

    def build(schedule=None, trace_dir=None):
        module = user_module(args.pp, args.width, args.layers)
        engine, _, _, _ = megatron_ds.initialize(model=module, model_parameters=module.parameters(),
                                                 config=ds_config(args, schedule, trace_dir))
        return engine

    result = {}
    pair = {"deepspeed": build(), "1f1b": build("1f1b")}
    names = {n: type(e).__name__ for n, e in pair.items()}
    cpu = {}
    times = timed(pair, args, args.warmup + args.iterations, cpu=cpu)
    result["pair"] = {n: t[args.warmup:] for n, t in times.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: t[args.warmup:] for n, t in cpu.items()})
    result["pair_cpu"] = gathered
    del pair
    dirs = {n: os.path.join(trace_root, n) for n in args.split}
    split = {n: build(n, dirs[n]) for n in args.split}
    names.update({n: type(e).__name__ for n, e in split.items()})
    for engine in split.values():
        engine.tracer.trace_dir = None
    timed(split, args, args.warmup)  # shapes learned, caches warm
    cpu, machine = {}, {}
    result["split"] = timed(split, args, 2 * args.iterations, start_step=args.warmup, cpu=cpu, trace_dirs=dirs,
                            machine=machine)
    for engine in split.values():
        engine.tracer.trace_dir = None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cpu)
    result["split_cpu"], result["machine"] = gathered, machine
    dist.barrier()
    if dist.get_rank() == 0:
        result["predicted"] = {n: predicted(dirs[n]) for n in split}
    result["engines"] = names
    return result


def split_row(name, times, result):
    """One split schedule's medians: its op costs and runtime gaps, simulated makespans, the measured untraced
    iteration, the paired ratios (all, and over the untraced iterations with the least other load) and that
    load (the machine's CPU time in an untraced iteration less the ranks' own, over its wall time, in cores)."""
    preds, machine = result["predicted"][name], result["machine"][name]
    ranks_cpu = [sum(rank[name][i] for rank in result["split_cpu"]) for i in range(len(times))]
    pairs = []  # (other load, untraced wall, the prediction of the traced iteration before it)
    for i in range(1, len(times), 2):
        step, used = machine[i - 1][0], machine[i][1]
        load = None if used is None else max(0.0, used - ranks_cpu[i]) / times[i]
        pairs.append((load, times[i], preds[step]["full"] + preds[step]["outside"]))
    quiet = sorted(pairs, key=lambda p: p[0] or 0.0)[:max(1, len(pairs) // 2)]
    med = lambda key: statistics.median(key(p) for p in preds.values())  # noqa: E731
    return {"costs": {k: med(lambda p: p["costs"][k]) for k in next(iter(preds.values()))["costs"]},
            "gaps": {k: med(lambda p: p["gaps"].get(k, 0.0)) for k in next(iter(preds.values()))["gaps"]},
            "sim": med(lambda p: p["sim"]), "full": med(lambda p: p["full"]), "outside": med(lambda p: p["outside"]),
            "pred_ops": med(lambda p: p["sim"] + p["outside"]), "pred": med(lambda p: p["full"] + p["outside"]),
            "measured": statistics.median(w for _, w, _ in pairs),
            "paired": statistics.median(w / p for _, w, p in pairs),
            "quiet": statistics.median(w / p for _, w, p in quiet),
            "load": statistics.median(p[0] for p in pairs) if all(p[0] is not None for p in pairs) else float("nan")}


def report(result, args):
    lines = [f"p={args.pp}, dp=1, m={args.gas}, micro-batch {args.mbs} x {args.width}, {args.layers} Linear+Tanh "
             f"layers, fp32 AdamW, ZeRO-1, gloo, 1 thread a rank; median of {args.iterations} iterations after "
             f"{args.warmup} warm-up (the split schedules: as many traced between them)", ""]
    pair, cpu = result["pair"], result["pair_cpu"]
    base = statistics.median(pair["deepspeed"])
    base_cpu = sum(statistics.median(rank["deepspeed"]) for rank in cpu)
    rows = []
    for name, t in pair.items():
        med = statistics.median(t)
        ranks = [statistics.median(rank[name]) for rank in cpu]
        rows.append([name, result["engines"][name], f"{med * 1e3:.1f}", f"{med / base:.3f}",
                     f"{paired_ratio(t, pair['deepspeed']):.3f}", " / ".join(f"{c * 1e3:.0f}" for c in ranks) + " ms",
                     f"{sum(ranks) / base_cpu:.3f}"])
    lines += table(["engine", "class", "iteration (ms)", "vs DeepSpeed", "paired ratio", "CPU s/iteration, ranks",
                    "CPU vs DeepSpeed"], "l" * 7, rows)
    control, rows = None, []
    for name, t in result["split"].items():
        row = split_row(name, t, result)
        control = row["paired"] if name == "1f1b" else control
        costs, gaps = row["costs"], row["gaps"]
        rows.append([name, " / ".join(f"{costs[k] * 1e3:.1f}" for k in ("F", "B", "W", "BW") if k in costs),
                     " / ".join(f"{gaps[k] * 1e3:.2f}" for k in ("F", "B", "W", "BW") if k in gaps),
                     f"{row['sim'] * 1e3:.1f} / {row['full'] * 1e3:.1f}", f"{row['outside'] * 1e3:.1f}",
                     f"{row['pred'] * 1e3:.1f}", f"{row['measured'] * 1e3:.1f}",
                     f"{row['measured'] / row['pred_ops']:.3f} / {row['measured'] / row['pred']:.3f}",
                     f"{row['paired']:.3f}", f"{row['quiet']:.3f}", f"{row['load']:.2f}",
                     f"{(row['paired'] / control) if control else float('nan'):.3f}"])
    lines += [""] + table(["schedule", "TF / TB / TW (ms, 1F1B stage)", "runtime per op: F / B / W (ms)",
                           "sim. makespan: op times only / with it (ms)", "+ outside ops (ms)", "predicted (ms)",
                           "measured (ms)", "meas/sim: op times only / with it", "paired", "quiet half: paired",
                           "other load (cores)", "paired over 1f1b's"], "l" * 12, rows)
    return "\n".join(lines)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--gas", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--mbs", type=int, default=64)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16, help="Linear layers (each followed by a Tanh)")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--trace-dir", help="keep the split schedules' traces here (default: a temporary folder)")
    ap.add_argument("--split", nargs="*", default=SPLIT, help="schedules measured against the simulator")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    machine = Machine()
    with tempfile.TemporaryDirectory(prefix="foreign_cost_") as scratch:
        results = run_ranks(args.pp, rank_main, args, args.trace_dir or scratch, timeout=args.timeout, quiet=True)
    return emit(f"{report(results[0], args)}\n\n{machine.before_after()}", args.perf_file, "bench.foreign_cost", argv)


if __name__ == "__main__":
    main()
