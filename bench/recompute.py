"""Megatron's recompute on CPU: peak activation memory per rank and step time of none, selective and full,
under 1F1B and ZB-V, with the simulator's prediction of each beside it.

A GPT-2-shaped model with Megatron's default dropouts (0.1: attention dropout makes torch's CPU attention the
unfused kernel, whose (s x s) probabilities, dropout mask and dropped probabilities per head are what selective
recompute frees; --attention-dropout 0 shows the fused kernel, where it frees the softmax statistics alone).
Each (schedule, recompute) cell runs in its own launch of --pp fresh processes (ZeRO-1, AdamW, fp32): one
warm-up iteration, one whose activation memory is metered (testing/saved_memory.SavedMemory: what autograd
saves, what DeepSpeed's checkpoint holds as its inputs and what a split backward's B queues for W, each storage
once, parameters not counted; its peak per rank), then --iterations timed ones (median of train_batch on rank 0,
after a barrier; --rounds launches per cell, every other round in reverse order, the best launch kept). On a
shared machine the wall time moves with the load; "cpu s" (the busiest rank's CPU seconds per iteration, its
process time: work, not waiting) shows what recomputing adds whatever else runs.

The prediction: schedules/recompute.evaluate, the memory model layer_memory (bytes per layer and micro-batch,
torch-free) over the schedule's op order, a rank's peak in bytes = its simulated peak x one unit (a 1F1B stage's
layers' activations, nothing recomputed; the embedding's and head's activations are not in the model, the
logits are: head_memory); times from one layer timed in this process (F, B, W as bench/layer_costs.py times
them; the embedding and head not modelled), and the attention core's share of a layer's forward, which selective
runs again in B: what selective adds to one layer's forward + backward over what a whole-layer recompute adds,
the modes timed in turns in this process (printed above the table, as each mode's cost of one layer).
"saving" is none's peak less the mode's on the same rank, measured and simulated: the check of the memory model.

    python -m bench.recompute                      # pp 2, 8 micro-batches, 8 layers, seq 512: about 10 minutes
    python -m bench.recompute --attention-dropout 0 --modes none selective
"""
from __future__ import annotations

import statistics
import sys
import time
import types

from bench.gpt_cpu import bench_ds_config, gpt_config as bench_gpt_config, random_batches
from bench.harness import Machine, Report, alternated, parser, rounds, table
from megatron_ds.testing.launcher import run_ranks

MB = 2 ** 20
MODES = {"none": {}, "selective": {"recompute_granularity": "selective"},
         "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
         "block1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}}
LABELS = {"none": "none", "selective": "selective", "full": "full uniform 1", "block1": "full block 1"}


def gpt_config(opts, mode="none"):
    return bench_gpt_config(opts, attention_dropout=opts["attention_dropout"], hidden_dropout=opts["hidden_dropout"],
                            **MODES[mode])


def worker(schedule, mode, opts):
    """One cell on this rank: {"peak": metered bytes, "times": [s], "cpu": [s], "loss": last loss}."""
    import deepspeed
    import torch
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.testing.saved_memory import SavedMemory

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    config = gpt_config(opts, mode)
    ds_config = bench_ds_config(opts, {"schedule": schedule})
    module = build_pipeline_module(config, ds_config, opts["pp"], seq_length=opts["seq"])
    engine = initialize_engine(module, ds_config, model_parameters=list(module.parameters()))
    batches = random_batches(config, opts)

    engine.train_batch(batches(0))  # warm-up: optimizer state, p2p buffers
    meter = SavedMemory(exclude=list(module.parameters()))
    with meter.recording():
        engine.train_batch(batches(1))
    cpu, losses = [], []

    def step(i):
        c0 = time.process_time()
        losses.append(float(engine.train_batch(batches(i))))
        cpu.append(time.process_time() - c0)
    times = alternated({"": step}, opts["iterations"], 2)[""]
    return {"peak": meter.peak, "times": times, "cpu": cpu, "loss": losses[-1]}


def layer_times(opts, repeats=7):
    """(TF, TB, TW, the attention core's forward) seconds of one layer (none), medians, as bench/layer_costs
    times a layer."""
    import torch
    from bench.harness import Timer
    from bench.layer_costs import time_passes
    from megatron_ds.model import TransformerLayer

    torch.set_num_threads(1)
    layer = TransformerLayer(gpt_config(opts), 1)
    shape = (opts["mbs"], opts["seq"], opts["hidden"])
    x, grad = torch.randn(shape, requires_grad=True), torch.randn(shape)

    def reset():
        x.grad = None
        layer.zero_grad(set_to_none=True)
    passes = types.SimpleNamespace(warmup=2, repeats=repeats)
    tf, tb, tw = time_passes(passes, Timer(torch.device("cpu")), lambda: layer(x),
                             lambda y: torch.autograd.backward(y, grad), reset)
    heads, d = opts["heads"], opts["hidden"] // opts["heads"]
    q, k, v = (torch.randn(opts["mbs"], heads, opts["seq"], d, requires_grad=True) for _ in range(3))
    core = [Timer(torch.device("cpu"))(lambda: layer.attn._masked_attention(q, k, v)) for _ in range(repeats + 2)]
    return tf, tb, tw, statistics.median(core[2:])


def layer_step_times(opts, modes, repeats=9):
    """{mode: seconds of one layer's forward and backward}, the modes taking turns in each repeat (the load of
    the moment hits all alike), the fastest repeat of each: a whole-layer recompute as the module runs it
    (DeepSpeed's checkpoint around the layer), selective as the layer runs it."""
    import torch
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
    from megatron_ds.model import TransformerLayer

    torch.set_num_threads(1)
    shape = (opts["mbs"], opts["seq"], opts["hidden"])
    x, grad = torch.randn(shape, requires_grad=True), torch.randn(shape)
    layers = {mode: TransformerLayer(gpt_config(opts, mode), 1) for mode in modes}

    def run(mode):
        whole = MODES[mode].get("recompute_granularity") == "full"
        return lambda _: torch.autograd.backward(checkpoint(layers[mode], x) if whole else layers[mode](x), grad)

    def reset(mode, i):  # off the clock
        x.grad = None
        layers[mode].zero_grad(set_to_none=True)
    times = alternated({mode: run(mode) for mode in modes}, repeats + 1, swap=False, prepare=reset)
    return {mode: min(t[1:]) for mode, t in times.items()}  # the first is a warm-up


def simulated(opts, schedule, mode, times, core_share):
    """(peak bytes per rank, makespan s) that schedules/recompute.evaluate predicts for the cell."""
    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.auto import LOGIT_BYTES
    from megatron_ds.schedules.costs import ModelCosts
    from megatron_ds.schedules.recompute import Recompute, evaluate, layer_memory

    config, pp, layers = gpt_config(opts, mode), opts["pp"], opts["layers"]
    memory = layer_memory(config, opts["seq"], opts["mbs"], 4)
    unit = memory.kept * layers / pp
    tf, tb, tw = times[:3]
    per_stage = layers / pp
    costs = ModelCosts(tf * per_stage, tb * per_stage, tw * per_stage,
                       head_memory=opts["seq"] * opts["mbs"] * opts["vocab"] * LOGIT_BYTES / unit)
    result = evaluate(build_schedule(schedule, pp, opts["gas"]), costs, Recompute.of(config), memory, layers,
                      core_share=core_share)
    return [units * unit for units in result.peak_memory], result.makespan


def run_cells(args, opts):
    runs = {(s, m): [] for s in args.schedules for m in args.modes}
    for rnd, (schedule, mode) in rounds(list(runs), args.rounds):
        print(f"round {rnd + 1}: {schedule} {LABELS[mode]} ...", file=sys.stderr, flush=True)
        runs[schedule, mode].append(run_ranks(args.pp, worker, schedule, mode, opts, timeout=1800, quiet=True))
    return runs


def busiest(ranks):
    """The most CPU seconds one rank spends per iteration (median over the timed ones)."""
    return max(statistics.median(r["cpu"]) for r in ranks)


def main(argv=None):
    ap = parser(__doc__, pp=2, gas=8, micro_batch_size=1, seq_length=512, hidden_size=256, num_layers=8,
                num_attention_heads=8, vocab_size=512)
    ap.add_argument("--attention-dropout", type=float, default=0.1)
    ap.add_argument("--hidden-dropout", type=float, default=0.1)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    out = Report(args.perf_file, "bench.recompute", argv)
    opts = dict(pp=args.pp, gas=args.gas, mbs=args.micro_batch_size, seq=args.seq_length, hidden=args.hidden_size,
                layers=args.num_layers, heads=args.num_attention_heads, vocab=args.vocab_size,
                attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                iterations=args.iterations)
    machine = Machine()
    times, steps = layer_times(opts), layer_step_times(opts, sorted(set(args.modes) | {"none", "selective", "full"}))
    # the core's share of a layer's forward: what selective adds over what a whole-layer recompute adds (both
    # timed in turns), steadier than the core timed alone
    core_share = (steps["selective"] - steps["none"]) / (steps["full"] - steps["none"])
    runs = run_cells(args, opts)
    out("", f"pp={args.pp} m={args.gas} mbs={args.micro_batch_size} seq={args.seq_length} hidden={args.hidden_size} "
        f"heads={args.num_attention_heads} layers={args.num_layers} vocab={args.vocab_size}, dropout "
        f"{args.attention_dropout} (attention) / {args.hidden_dropout} (hidden), fp32 on CPU, {args.rounds} "
        f"launches per cell, best kept",
        f"one layer: F {times[0] * 1e3:.1f} ms, B {times[1] * 1e3:.1f} ms, W {times[2] * 1e3:.1f} ms; the "
        f"attention core's forward alone {times[3] * 1e3:.1f} ms ({times[3] / times[0]:.0%} of F), its share of F "
        f"from the turns below {core_share:.0%} (the simulation's)",
        "one layer's forward + backward, the modes taking turns (fastest of 9): " + ", ".join(
            f"{LABELS[m]} {steps[m] * 1e3:.1f} ms ({steps[m] / steps['none']:.2f}x)" for m in MODES if m in steps), "")
    rows = []
    for schedule in args.schedules:
        base = min(runs[schedule, args.modes[0]], key=lambda ranks: statistics.median(ranks[0]["times"]))
        base_sim = simulated(opts, schedule, args.modes[0], times, core_share)
        for mode in args.modes:
            best = min(runs[schedule, mode], key=lambda ranks: statistics.median(ranks[0]["times"]))
            peaks, makespan = simulated(opts, schedule, mode, times, core_share)
            step = statistics.median(best[0]["times"])
            for rank, res in enumerate(best):
                saving, sim_saving = base[rank]["peak"] - res["peak"], base_sim[0][rank] - peaks[rank]
                timing = [f"{step:.2f}", f"{step / statistics.median(base[0]['times']):.2f}", f"{busiest(best):.2f}",
                          f"{busiest(best) / busiest(base):.2f}", f"{makespan / base_sim[1]:.2f}"] if rank == 0 else []
                rows.append([schedule if mode == args.modes[0] and rank == 0 else "", LABELS[mode] if rank == 0 else "",
                             rank, f"{res['peak'] / MB:.1f}", f"{peaks[rank] / MB:.1f}", f"{saving / MB:.1f}",
                             f"{sim_saving / MB:.1f}", f"{sim_saving / saving:.3f}" if saving > 0 else "-"]
                            + (timing or [""] * 5))
    out(*table(["schedule", "recompute", "rank", "peak MB", "sim MB", "saving MB", "sim", "sim/meas", "step s",
                "x none", "cpu s", "x none", "sim x"], "llrrrrrrrrrrr", rows), "", machine.before_after())
    out.save()


if __name__ == "__main__":
    main()
