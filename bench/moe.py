"""A small mixture-of-experts GPT under the schedules on CPU: iteration time, the all-to-all's share, memory.

Each schedule runs in its own launch of pp x dp ranks (gloo, ZeRO-1, AdamW, fp32, random tokens): the experts
split over ep of each stage's dp ranks, tokens dispatched and combined by all-to-all. iteration = median wall
time of train_batch on rank 0 (after a barrier) in the best of --rounds launches; all-to-all = the time every
rank spent inside torch.distributed.all_to_all_single (the counts and the token rows, forward and backward,
waiting for peers included), as a share of its iterations' time, mean over ranks; peak / train RSS as in
bench/gpt_cpu.py. Oversubscribed on a 2-core machine (4 ranks): ranks compete for cores, and an all-to-all
that waits for a peer's compute counts that wait.

    python -m bench.moe                                  # pp 2 x dp 2, EP 2, every schedule below
    python -m bench.moe --engines 1f1b zbv --iterations 3
"""
from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings

from bench.gpt_cpu import gpt_config, random_batches, timed_iterations
from bench.harness import Machine, Report, parser, rounds, table
from megatron_ds.testing.launcher import run_ranks

ENGINES = {"DS 1F1B (stock)": None, "1f1b": {"schedule": "1f1b"}, "zb-h1": {"schedule": "zb-h1"},
           "zbv": {"schedule": "zbv"}, "bitpipe": {"schedule": "bitpipe"}, "dualpipev": {"schedule": "dualpipev"}}


class AllToAllClock:
    """Seconds spent in torch.distributed.all_to_all_single while installed (the MoE dispatch calls it)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.original, self.seconds = dist, dist.all_to_all_single, 0.0

    def _timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __enter__(self):
        self.dist.all_to_all_single = self._timed
        return self

    def __exit__(self, *exc):
        self.dist.all_to_all_single = self.original


def worker(name, opts):
    import deepspeed
    import torch
    from megatron_ds.moe_config import MoEConfig
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.moe.moe import optimizer_param_groups

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    moe = MoEConfig(num_experts=opts["experts"], router_topk=opts["topk"], expert_model_parallel_size=opts["ep"],
                    aux_loss_coeff=0.01)
    config = gpt_config(opts, swiglu=True, normalization="rmsnorm", position_embedding_type="rope",
                        add_bias_linear=False, untie_embeddings_and_output_weights=True, moe=moe)
    ds_config = {"train_micro_batch_size_per_gpu": opts["mbs"], "gradient_accumulation_steps": opts["gas"],
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    if ENGINES[name]:
        ds_config["pipeline"] = dict(ENGINES[name])
    module = build_pipeline_module(config, ds_config, opts["pp"], seq_length=opts["seq"])
    groups = [{"params": [p for p in module.parameters()], "name": "all"}]
    optimizer = torch.optim.AdamW(optimizer_param_groups(groups), lr=1e-4)
    engine = initialize_engine(module, ds_config, optimizer=optimizer)

    batches = random_batches(config, opts, engine.grid.get_data_parallel_rank())
    times, losses, every = timed_iterations(engine, batches, opts, AllToAllClock())
    return {"times": times, "losses": losses, "ranks": every,
            "load": (engine.router_metrics or {}).get("expert_load", {})}


def main(argv=None):
    ap = parser(__doc__, pp=2, gas=8, micro_batch_size=2, seq_length=128, hidden_size=128, num_layers=4,
                num_attention_heads=4, vocab_size=2048)
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks per stage")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel size (divides --dp)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="launches per schedule; the best one counts")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="NAME")
    args = ap.parse_args(argv)
    opts = dict(pp=args.pp, gas=args.gas, mbs=args.micro_batch_size, seq=args.seq_length, hidden=args.hidden_size,
                layers=args.num_layers, heads=args.num_attention_heads, vocab=args.vocab_size, ep=args.ep,
                experts=args.experts, topk=args.topk, iterations=args.iterations, warmup=args.warmup)
    procs, machine, out = args.pp * args.dp, Machine(), Report(args.perf_file, "bench.moe", argv)
    out(f"# bench/moe.py: MoE GPT {opts['layers']} layers, hidden {opts['hidden']}, {args.experts} experts top-"
        f"{args.topk} (SwiGLU, RMSNorm, RoPE), seq {opts['seq']}, vocab {opts['vocab']}; p={args.pp} x dp={args.dp}, "
        f"EP {args.ep}, m={args.gas}, micro-batch {opts['mbs']}; ZeRO-1 AdamW fp32; median of {args.iterations} "
        f"iterations after {args.warmup} warm-up, best of {args.rounds} launches; {procs} processes on "
        f"{machine.cores} cores; {machine.at_start()}")
    runs = {name: [] for name in args.engines}
    for rnd, name in rounds(args.engines, args.rounds):
        print(f"round {rnd + 1}: {name} ...", file=sys.stderr, flush=True)
        runs[name].append(run_ranks(procs, worker, name, opts, timeout=1800, quiet=True)[0])
    best = {name: min(statistics.median(r["times"]) for r in rs) for name, rs in runs.items()}
    base, mb, rows = best.get("DS 1F1B (stock)"), 1024 * 1024, []
    for name, rs in runs.items():
        launch = min(rs, key=lambda r: statistics.median(r["times"]))
        share = statistics.mean(k["clock"] for k in launch["ranks"]) / sum(launch["times"])
        rows.append([name, f"{best[name]:.3f}", " ".join(f"{statistics.median(r['times']):.2f}" for r in rs),
                     f"{best[name] / base:.3f}" if base else "", f"{share:.1%}",
                     " ".join(f"{k['peak'] / mb:.0f}" for k in launch["ranks"]),
                     " ".join(f"{k['train'] / mb:.0f}" for k in launch["ranks"]),
                     " ".join(f"{v:.2f}" for _, v in sorted(launch["load"].items())), f"{launch['losses'][-1]:.4f}"])
    out("", *table(["schedule", "iteration (s)", "per launch (s)", "iteration / DS 1F1B's (lower is better)",
                    "all-to-all share of the step", "peak RSS per rank (MB)", "train RSS per rank (MB)",
                    "expert load max/mean (last step)", "loss"], "lrlrrlllr", rows), "", machine.at_end())
    out.save()


if __name__ == "__main__":
    main()
