"""What megatron_ds.initialize costs on a user's own PipelineModule: a Linear/Tanh stack on CPU.

Two comparisons, in one launch of p gloo ranks (one thread each):
- our engine under 1f1b against DeepSpeed's stock PipelineEngine on the same module and data, the two engines
  built side by side in each process and their iterations alternated (the order swapped every iteration), so
  machine noise hits both alike: median train_batch wall time (rank 0, after a barrier) and their ratio, the
  median of the ratios of neighbouring iterations (slow drifts of the machine's load cancel), and each rank's
  CPU time per iteration (what the process itself spends, which waiting for a core on a loaded machine does
  not inflate);
- zbv and dualpipev (the B/W split through autograd): a few traced iterations give each op kind's median time
  (schedules.timeline.median_costs: TF, TB, TW of one 1F1B stage), which the simulator
  (megatron_ds.schedules.simulate, on the op order the ranks ran) turns into a makespan; the prediction adds
  what the traces hold outside the compute ops (data before the first op, the optimizer step after the last).
  meas/sim = the median untraced iteration over that prediction; best: the fastest untraced iteration over the
  least of the traced steps' predictions (the least disturbed of each, on a shared machine). Our 1f1b is traced
  and simulated alike as the control: on a loaded machine every iteration stretches by waits for a core that
  no op time holds, and its meas/sim is that stretch, by which the last column divides. The engines of this
  part are timed in alternation too.

    python -m bench.foreign_cost                       # p=2, about 2 minutes on 2 idle cores
    python -m bench.foreign_cost --pp 4 --gas 8 --width 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

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


def timed(engines, args, iterations, start_step=0, cpu=None):
    """{name: [wall seconds of train_batch]}, the engines alternated, their order swapped every iteration;
    `cpu` (a dict) gets the process's CPU seconds of each (its threads', gloo's included)."""
    import torch.distributed as dist
    times = {name: [] for name in engines}
    names = list(engines)
    for it in range(iterations):
        for name in (names if it % 2 == 0 else names[::-1]):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            engines[name].train_batch(batches(args, start_step + it))
            times[name].append(time.perf_counter() - start)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - start_cpu)
    return times


def predicted(trace_dir):
    """The simulator's iteration for each traced step of `trace_dir`: (makespan from the measured median op
    costs + the traced time outside the compute ops, the costs, the traced span)."""
    from megatron_ds.schedules import simulate
    from megatron_ds.schedules.timeline import load_iteration, measure, median_costs, steps, to_schedule
    out = []
    for step in steps(trace_dir):
        traces = load_iteration(trace_dir, step)
        costs = median_costs(traces)
        got = measure(traces)
        schedule = to_schedule(traces)
        sim = simulate(schedule, costs.get("F"), costs.get("B", costs.get("BW", 0.0) / 2),
                       costs.get("W", costs.get("BW", 0.0) / 2))
        out.append((sim.makespan + (got.span - got.makespan), costs, got.span, sim.makespan, got.makespan))
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
    split = {n: build(n, os.path.join(trace_root, n)) for n in args.split}
    names.update({n: type(e).__name__ for n, e in split.items()})
    for engine in split.values():
        engine.tracer.trace_dir = None
    timed(split, args, args.warmup)  # shapes learned, caches warm
    for n, engine in split.items():
        engine.tracer.trace_dir = os.path.join(trace_root, n)
    timed(split, args, args.traced, start_step=args.warmup)
    for engine in split.values():
        engine.tracer.trace_dir = None
    result["split"] = timed(split, args, args.iterations, start_step=args.warmup + args.traced)
    dist.barrier()
    if dist.get_rank() == 0:
        result["predicted"] = {n: predicted(os.path.join(trace_root, n)) for n in split}
    result["engines"] = names
    return result


def report(result, args):
    lines = [f"p={args.pp}, dp=1, m={args.gas}, micro-batch {args.mbs} x {args.width}, {args.layers} Linear+Tanh "
             f"layers, fp32 AdamW, ZeRO-1, gloo, 1 thread a rank; median of {args.iterations} iterations after "
             f"{args.warmup} warm-up", "",
             "| engine | class | iteration (ms) | vs DeepSpeed | paired ratio | CPU s/iteration, ranks | "
             "CPU vs DeepSpeed |", "|---|---|---|---|---|---|---|"]
    pair, cpu = result["pair"], result["pair_cpu"]
    base = statistics.median(pair["deepspeed"])
    base_cpu = sum(statistics.median(rank["deepspeed"]) for rank in cpu)
    for name, t in pair.items():
        med = statistics.median(t)
        paired = statistics.median(a / b for a, b in zip(t, pair["deepspeed"]))  # iteration by iteration
        ranks = [statistics.median(rank[name]) for rank in cpu]
        lines.append(f"| {name} | {result['engines'][name]} | {med * 1e3:.1f} | {med / base:.3f} | {paired:.3f} | "
                     f"{' / '.join(f'{c * 1e3:.0f}' for c in ranks)} ms | {sum(ranks) / base_cpu:.3f} |")
    lines += ["", "| schedule | TF / TB / TW (ms, 1F1B stage) | sim. makespan (ms) | + outside ops (ms) | "
                  "predicted (ms) | measured (ms) | meas/sim | best: predicted / measured (ms) | best meas/sim | "
                  "meas/sim over 1f1b's |", "|---|---|---|---|---|---|---|---|---|---|"]
    control = None
    for name, t in result["split"].items():
        preds = result["predicted"][name]
        pred = statistics.median(p[0] for p in preds)
        costs = {k: statistics.median(p[1][k] for p in preds) for k in preds[0][1]}
        sim = statistics.median(p[3] for p in preds)
        med = statistics.median(t)
        best_pred, best = min(p[0] for p in preds), min(t)
        control = med / pred if name == "1f1b" else control
        op = " / ".join(f"{costs[k] * 1e3:.1f}" for k in ("F", "B", "W", "BW") if k in costs)
        lines.append(f"| {name} | {op} | {sim * 1e3:.1f} | {(pred - sim) * 1e3:.1f} | {pred * 1e3:.1f} | "
                     f"{med * 1e3:.1f} | {med / pred:.3f} | {best_pred * 1e3:.1f} / {best * 1e3:.1f} | "
                     f"{best / best_pred:.3f} | {(med / pred / control) if control else float('nan'):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--gas", type=int, default=8, help="micro-batches per iteration")
    parser.add_argument("--mbs", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16, help="Linear layers (each followed by a Tanh)")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--traced", type=int, default=6, help="traced iterations of each split schedule")
    parser.add_argument("--split", nargs="*", default=SPLIT, help="schedules measured against the simulator")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="foreign_cost_") as trace_root:
        results = run_ranks(args.pp, rank_main, args, trace_root, timeout=args.timeout, quiet=True)
    text = report(results[0], args) + (f"\n\nload average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after, on "
                                        f"{os.cpu_count()} cores")
    print(text)
    return text


if __name__ == "__main__":
    main()
