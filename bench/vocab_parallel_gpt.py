"""Vocabulary parallelism on a real small GPT: iteration time with and without it, each schedule.

A GPT whose vocabulary is many times its hidden width (default hidden 128, vocabulary 8192: by
FLOPs the head + loss then costs several transformer layers, the header says how many) trains
at p ranks (gloo, one thread each, ZeRO-1, AdamW, fp32, random tokens): naive placement
("type:transformer": the embedding on the first stage, the head on the last) against
ds_config "pipeline.vocab_parallel": true, under each schedule. Every engine is built in one
launch and the engines take turns iteration by iteration on the same batches, so machine noise
hits all alike; both placements start from the same weights (the slices are cut from the whole
matrices), so their losses agree, which the table shows.

iteration = median wall time of train_batch on rank 0 (after a barrier); vp/naive = throughput
with vocabulary parallelism over naive placement's (naive iteration / vocab iteration); loss
diff = the largest |vocab loss - naive loss| over the timed iterations.

On a 2-core machine p=4 ranks are oversubscribed: a rank's bubble is partly filled by another
rank's work, so balance shows less than on p devices (bench/vocab_parallel_timed.py measures the
schedules themselves, on timed layers).

    python -m bench.vocab_parallel_gpt                    # p=4, 1f1b and zbv, about 5 minutes
    python -m bench.vocab_parallel_gpt --vocab-size 16384 --hidden-size 64 --iterations 9
"""
from __future__ import annotations

import logging
import statistics
import sys
import warnings

from bench.gpt_cpu import bench_ds_config, gpt_config, random_batches
from bench.harness import Machine, alternated, emit, parser, table
from bench.vocab_parallel import SCHEDULES
from megatron_ds.testing.launcher import run_ranks

PLACEMENTS = ("naive", "vocab")


def head_in_layers(opts) -> float:
    """The head + loss's forward FLOPs per token over one transformer layer's (pipe/plan/partition.py)."""
    from megatron_ds.pipe.plan.partition import layer_flops
    flops = layer_flops(gpt_config(opts))
    return flops[-1] / flops[1]


# -- worker side (one process per pipeline rank) -------------------------------------------------

def build_engine(schedule, placement, opts):
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    pipeline = dict(SCHEDULES[schedule], schedule=schedule, vocab_parallel=placement == "vocab")
    ds_config = bench_ds_config(opts, pipeline, gradient_clipping=1.0)
    module = build_pipeline_module(gpt_config(opts), ds_config, opts["pp"], seq_length=opts["seq"])
    return initialize_engine(module, ds_config, model_parameters=list(module.parameters()))


def worker(opts):
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*c10d::broadcast_")  # DeepSpeed's tied-weight broadcast
    torch.set_num_threads(1)
    cells = [(s, pl) for s in opts["schedules"] for pl in PLACEMENTS]
    engines = {cell: build_engine(*cell, opts) for cell in cells}
    losses = {cell: [] for cell in cells}

    def run(cell):
        return lambda data: losses[cell].append(float(engines[cell].train_batch(iter(data))))
    # each step's batches, drawn once off the clock: every engine trains on the same ones
    drawn, draw = {}, random_batches(gpt_config(opts), opts)
    times = alternated({cell: run(cell) for cell in cells}, opts["warmup"] + opts["iterations"],
                       prepare=lambda cell, step: drawn.setdefault(step, list(draw(step))))
    return {f"{s}|{pl}": {"times": times[(s, pl)], "losses": losses[(s, pl)]} for s, pl in cells}


# -- analysis --------------------------------------------------------------------------------------

def analyse(results, opts):
    """{schedule: {"naive": row, "vocab": row, "ratio": vp/naive, "loss_diff": ...}}; timed iterations only."""
    table = {}
    for schedule in opts["schedules"]:
        rows = table[schedule] = {}
        for placement in PLACEMENTS:
            r = results[f"{schedule}|{placement}"]
            times = r["times"][opts["warmup"]:]
            rows[placement] = {"iteration": statistics.median(times), "times": times, "losses": r["losses"]}
        n, v = rows["naive"], rows["vocab"]
        rows["ratio"] = n["iteration"] / v["iteration"]
        rows["loss_diff"] = max(abs(a - b) for a, b in zip(n["losses"], v["losses"]))
    return table


def markdown(results, opts):
    tokens = opts["gas"] * opts["mbs"] * opts["seq"]
    lines = [f"**GPT {opts['layers']} layers, hidden {opts['hidden']}, {opts['heads']} heads, seq {opts['seq']}, "
             f"vocabulary {opts['vocab']} (head + loss = {head_in_layers(opts):.1f} layers by FLOPs); p={opts['pp']}, "
             f"m={opts['gas']}, micro-batch {opts['mbs']}; ZeRO-1 AdamW fp32** (iteration times in ms)", ""]
    lines += table(["schedule", "naive", "vocab", "vp/naive", "tokens/s naive", "tokens/s vocab", "last loss",
                    "loss diff"], "lrrrrrrr",
                   [[name, f"{rows['naive']['iteration'] * 1e3:.0f}", f"{rows['vocab']['iteration'] * 1e3:.0f}",
                     f"{rows['ratio']:.3f}", f"{tokens / rows['naive']['iteration']:.0f}",
                     f"{tokens / rows['vocab']['iteration']:.0f}", f"{rows['vocab']['losses'][-1]:.4f}",
                     f"{rows['loss_diff']:.1e}"] for name, rows in results.items()])
    return "\n".join(lines)


def main(argv=None):
    ap = parser(__doc__, pp=4, gas=8, micro_batch_size=2, seq_length=128, hidden_size=128, num_layers=8,
                num_attention_heads=4, vocab_size=8192)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"], choices=list(SCHEDULES))
    ap.add_argument("--iterations", type=int, default=7, help="timed iterations per engine")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the launch")
    args = ap.parse_args(argv)
    opts = {"pp": args.pp, "gas": args.gas, "mbs": args.micro_batch_size, "seq": args.seq_length,
            "hidden": args.hidden_size, "layers": args.num_layers, "heads": args.num_attention_heads,
            "vocab": args.vocab_size, "schedules": args.schedules, "iterations": args.iterations,
            "warmup": args.warmup}
    machine = Machine()
    head = (f"# bench/vocab_parallel_gpt.py on {machine.cores} CPU cores (p={args.pp} ranks), {machine.at_start()}; "
            f"median of {args.iterations} iterations (+{args.warmup} warm-up) per engine, engines taking turns")
    print(head, flush=True)
    results = run_ranks(args.pp, worker, opts, timeout=args.timeout, quiet=True)[0]
    emit("\n" + markdown(analyse(results, opts), opts) + f"\n\n# {machine.at_end()}", args.perf_file,
         "bench.vocab_parallel_gpt", argv, printed_before=head + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
