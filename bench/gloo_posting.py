"""Posting every receive at an iteration's start on gloo (ScheduleEngine.posts_all), against posting each one op
ahead: the GPT engine on CPU, paired in one launch.

gloo moves a message only once its receive is posted. Posted one op ahead, a message sent ops before it is needed
(zbv's, the V schedules') waits for that post and then for the sender's gloo thread to get a core from the busy
compute threads (docs/perf/foreign_cpu.md found it for users' own pipeline models). Each schedule's engine runs
its iterations with posting at the start and without it alternately (the order swapped every pair), so the
machine's noise hits both alike; ratio = the median of the paired ratios (at the start / one op ahead; below 1:
posting at the start is faster). Same model and data as bench/gpt_cpu.py.

    python -m bench.gloo_posting                       # p=4, zbv and 1f1b, about 4 minutes on 2 cores
    python -m bench.gloo_posting --engines zbv --iterations 6
"""
from __future__ import annotations

import logging
import statistics
import warnings

from bench.engines import STOCK, DUALPIPEV, engines
from bench.gpt_cpu import build, model_opts, random_batches
from bench.harness import Machine, alternated, emit, paired_ratio, parser, table
from megatron_ds.testing.launcher import run_ranks

ENGINES = [name for name in engines() if name not in (STOCK, DUALPIPEV)]  # ours: DeepSpeed's post their own way


def worker(name, opts):
    import deepspeed
    import torch
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    config, engine = build(name, opts)
    if isinstance(engine, str):
        return {"na": engine}
    batches = random_batches(config, opts)
    for step in range(opts["warmup"]):
        engine.train_batch(batches(step))

    def posting(way, step):  # off the clock
        engine.posts_all = way
        return step

    def train(step):
        engine.train_batch(batches(step))
    return alternated({True: train, False: train}, opts["iterations"], opts["warmup"], prepare=posting)


def main(argv=None):
    ap = parser(__doc__, pp=4, gas=8, micro_batch_size=2, seq_length=256, hidden_size=256, num_layers=8,
                num_attention_heads=8, vocab_size=2048)
    ap.add_argument("--iterations", type=int, default=6, help="timed iterations of each way")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--engines", nargs="+", default=["zbv", "1f1b"], choices=ENGINES, metavar="NAME",
                    help=f"subset of: {', '.join(ENGINES)}")
    args = ap.parse_args(argv)
    opts = {**model_opts(args), "tp": 1}
    machine = Machine()
    rows, cells = {}, []
    for name in args.engines:
        times = run_ranks(args.pp, worker, name, opts, timeout=1800, quiet=True)[0]
        if "na" in times:
            cells.append([name, times["na"], "", ""])
            continue
        start, ahead = times[True], times[False]
        r = rows[name] = dict(start=statistics.median(start), ahead=statistics.median(ahead),
                              ratio=paired_ratio(start, ahead))
        cells.append([name, f"{r['start']:.3f}", f"{r['ahead']:.3f}", f"{r['ratio']:.3f}"])
    lines = [f"GPT {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}; p={args.pp}, "
             f"m={args.gas}, micro-batch {args.micro_batch_size}; ZeRO-1 AdamW fp32, gloo; {args.iterations} "
             "paired iterations", ""]
    lines += table(["schedule", "posted at the start (s)", "one op ahead (s)", "ratio (paired median)"], "lrrr", cells)
    lines.append(f"\n{machine.before_after()}")
    emit("\n".join(lines), args.perf_file, "bench.gloo_posting", argv)
    return rows


if __name__ == "__main__":
    main()
