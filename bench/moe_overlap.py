"""Hiding the experts' all-to-all on CPU: overlapped forward-and-backward units against plain ops.

A small MoE GPT (every layer MoE, expert parallelism 2) at PP2 x DP2: 4 gloo ranks, one thread each. Each
schedule of --schedules runs plain and overlapped ("pipeline": {"schedule": S, "overlap": true}), the two engines
built side by side in each process and their iterations alternated (the order swapped every iteration), so the
machine's noise hits both alike; the ratio is the median of the paired ratios of neighbouring iterations.

The all-to-all's share of the step is set with the test-only latency knob (model/moe_dispatch.py
MEGATRON_DS_TEST_A2A_LATENCY_MS: every all-to-all ends N ms after its transfer, blocking or issued; the
overlapped runtime can hide it while it is in flight). Calibration: the plain step without latency, T0 (median),
and the all-to-alls of one step on the busiest rank, n; a share s of the plain step is then N = s T0 / (n (1 - s))
per all-to-all (what it adds is s of the new step; gloo's own all-to-all time is counted in T0).

Simulated (schedules/simulate.py, as pipe/auto.py feeds it, with one change): traced plain iterations, alternated
with the timed ones so that both come from the same minutes of a noisy machine, give per (op kind, stage) the
median compute of an op plus the runtime's time between ops (pipe/auto's gap), the median all-to-all inside F and
B ops and how many there are (the units run piece by piece, `simulate(all_to_all_count=)`), and the p2p time the
traces show (pipe/auto.traced_latencies); the overlapped units' pieces pay the host time pipe/auto.piece_host
measures. The change: the all-to-all the simulator may hide is only the knob's sleep (its ms x the all-to-alls
inside the op); gloo's own time inside an all-to-all (the transfer and the wait for the EP peer) stays in the
op's compute. On this machine (4 ranks on 2 cores) that wait is mostly for the peer to get a core, while the
sleep leaves the cores free. pipe/auto charges every traced all-to-all as hideable, which is right where a rank
has its own processor and the all-to-all is the network's time; the bench keeps one model for every row.
predicted = the simulated makespan + the traced time outside the compute ops (loading, the optimizer step);
meas/sim = the median measured iteration over it, for the plain and the overlapped engine.

Columns: a2a share: the target, slept: the busiest rank's knob sleep over its plain iteration (what the
simulator may hide), traced: its whole all-to-all time, gloo's included;
plain, overlapped: median train_batch wall time on rank 0 (after a barrier); ratio: paired overlapped/plain;
sim. ratio: predicted overlapped / predicted plain; meas/sim plain and overlapped; ratio / sim. ratio: how far
the measured gain is from the simulated one (a stretch common to both engines, such as waiting for one of the
2 cores, cancels).

m = 16 micro-batches by default, fair to both schedules: dualpipev at PP 2 pairs 11 of a rank's 16 forwards in
units at m = 8 (its warm-up and cool-down are fixed), 27 of 32 at m = 16; 1f1b 5-7 of 8 and 13-15 of 16. Share 0
(no latency) measures what the runtime's units cost or gain by themselves.

    python -m bench.moe_overlap                               # about 4 minutes on 2 quiet cores
    python -m bench.moe_overlap --schedules 1f1b --shares 0.3 --iterations 4
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import sys
import warnings

from bench.gpt_cpu import random_batches
from bench.harness import Machine, alternated, emit, paired_ratio, parser, table
from megatron_ds.testing.launcher import run_ranks

SCHEDULES = ("dualpipev", "1f1b")
SHARES = (0.0, 0.1, 0.3, 0.5)  # 0: the units' own cost (or gain) with nothing added to hide
WORLD_DP = 2  # data-parallel ranks per stage: EP 2 splits each MoE layer's experts over them


def model_config(args):
    from megatron_ds.model import GPTConfig
    from megatron_ds.moe_config import MoEConfig
    moe = MoEConfig(num_experts=args.experts, router_topk=2, expert_model_parallel_size=2, aux_loss_coeff=0.01)
    return GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length,
                     swiglu=True, normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, moe=moe, seed=1234)


def build(config, args, section):
    import torch
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.moe.moe import optimizer_param_groups
    ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch_size, "gradient_accumulation_steps": args.gas,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                 "pipeline": dict(section)}
    module = build_pipeline_module(config, ds_config, args.pp, seq_length=args.seq_length)
    optimizer = torch.optim.AdamW(optimizer_param_groups([{"params": list(module.parameters()), "name": "all"}]),
                                  lr=1e-4)
    return initialize_engine(module, ds_config, optimizer=optimizer)


def timed(engines: dict, data, iterations: int, start: int) -> dict:
    """{name: [seconds of train_batch]}, the engines alternated, their order swapped every iteration."""
    return alternated({name: engine.train_batch for name, engine in engines.items()}, iterations, start,
                      prepare=lambda name, step: data(step))


class Recorder:
    """The engine tracer's listener for a few plain iterations: per (kind, stage) each op's compute (its time
    less the all-to-alls inside it) and those all-to-alls, the runtime's time between ops (pipe/auto's gap),
    the ops' (start, end, wait start) for the p2p latencies, and each iteration's all-to-all count and time."""

    def __init__(self, engine):
        self.engine, self.compute, self.comm = engine, {}, {}
        self.gaps, self.ops, self.counts, self.a2a, self.spans, self.sleeps = [], [], [], [], [], []
        self.count = {}

    def __call__(self, trace):
        from megatron_ds.model.moe_dispatch import AllToAllTimes, added_latency
        from megatron_ds.schedules import Op
        from megatron_ds.schedules.timeline import COMPUTE, P2P
        intervals = sorted(AllToAllTimes.intervals or [])
        AllToAllTimes.intervals = []
        self.counts.append(len(intervals))
        self.a2a.append(sum(e - s for s, e in intervals))
        compute = [(s, e, a) for _, tid, s, e, a in trace.events if tid == COMPUTE]
        latency = added_latency()
        self.sleeps.append(latency * len(intervals))
        for s, e, a in compute:
            key = (a["kind"].name, a["stage"])
            # Only the knob's sleep is hideable here: each all-to-all in the op sleeps `latency` (cores free);
            # gloo's own transfer and wait for the peer stays in the op's compute (on 2 cores it is waiting for
            # a core, which no overlap frees). The model is the same for every row.
            inside = sum(1 for a0, a1 in intervals if s <= (a0 + a1) / 2 <= e)  # the op's all-to-alls
            slept = latency * inside
            self.compute.setdefault(key, []).append(e - s - slept)
            self.comm.setdefault(key, []).append(slept)
            self.count.setdefault(key, []).append(inside)
        waits = {e: s for name, tid, s, e, _ in trace.events if tid == P2P and name.startswith("recv")}
        self.ops.append({Op(a["kind"], a["replica"], a["stage"], a["mb"], a["seq"]): (s, e, waits.get(s))
                         for s, e, a in compute})
        first, last = min(c[0] for c in compute), max(c[1] for c in compute)
        other = sum(min(e, last) - max(s, first) for _, tid, s, e, _ in trace.events
                    if tid != COMPUTE and e > first and s < last)
        self.gaps.append(max(0.0, last - first - sum(e - s for s, e, _ in compute) - other) / len(compute))
        self.spans.append((min(ev[2] for ev in trace.events), max(ev[3] for ev in trace.events), first, last))

    def summary(self):
        med = {k: statistics.median(v) for k, v in self.compute.items()}
        comm = {k: statistics.median(v) for k, v in self.comm.items()}
        count = {k: round(statistics.median(v)) for k, v in self.count.items()}
        return dict(compute=med, comm=comm, count=count, gap=statistics.median(self.gaps), ops=self.ops,
                    counts=self.counts, a2a=self.a2a, spans=self.spans, sleeps=self.sleeps)


def traced(engine, data, iterations: int, start: int, rec: Recorder | None = None) -> Recorder:
    """`iterations` plain iterations of `engine` with its op trace and all-to-all times going to `rec` (new if
    None), which it returns."""
    from megatron_ds.model.moe_dispatch import AllToAllTimes
    rec = rec or Recorder(engine)
    engine.tracer.listener, AllToAllTimes.intervals = rec, []
    try:
        timed({"plain": engine}, data, iterations, start)
    finally:
        engine.tracer.listener, AllToAllTimes.intervals = None, None
    return rec


def stage_costs(records: list, stages: int):
    """Per stage (tf, tb, tw) compute, each with the runtime's time between ops, and (F, B) all-to-all: medians
    over the ranks of their medians, and (F, B) the all-to-alls inside an op. A schedule without B and W ops
    (1f1b's BW) splits BW evenly: the simulator charges a BW both, and only their sum counts."""
    gap = statistics.median(r["gap"] for r in records)

    def med(table, kind, stage):
        values = [r[table][(kind, stage)] for r in records if (kind, stage) in r[table]]
        return statistics.median(values) if values else None
    f, b, w, fa, ba, ka, kb = [], [], [], [], [], [], []
    for s in range(stages):
        split = med("compute", "B", s) is not None
        bw = med("compute", "BW", s)
        f.append(med("compute", "F", s) + gap)
        b.append(med("compute", "B", s) + gap if split else bw / 2 + gap / 2)
        w.append(med("compute", "W", s) + gap if split else bw / 2 + gap / 2)
        fa.append(med("comm", "F", s))
        ba.append(med("comm", "B" if split else "BW", s))
        ka.append(round(med("count", "F", s)))
        kb.append(round(med("count", "B" if split else "BW", s)))
    return f, b, w, fa, ba, (ka, kb)


def predict(schedule, records: list, piece_host: float, pieces: list, plain_schedule) -> float:
    """The simulated iteration of `schedule` from the plain run's records (of `plain_schedule`, placed alike):
    makespan plus the traced time outside the compute ops."""
    from megatron_ds.pipe.auto import traced_latencies
    from megatron_ds.schedules.simulate import simulate
    f, b, w, fa, ba, counts = stage_costs(records, schedule.stages)
    traced = [(socket.gethostname(), r["dp"], r["ops"]) for r in records]
    latencies = traced_latencies(traced, [plain_schedule] * len(records[0]["ops"]))
    p2p = statistics.median(latencies) if latencies else 0.0
    host = [piece_host * n for n in pieces] if schedule.overlap else 0.0
    sim = simulate(schedule, f, b, w, all_to_all=(fa, ba), p2p_latency=p2p, overlap_host=host,
                   all_to_all_count=counts)
    outside = []  # per iteration: all ranks' first event to their last, less their first op to their last op
    for spans in zip(*(r["spans"] for r in records)):
        span = max(s[1] for s in spans) - min(s[0] for s in spans)
        outside.append(span - (max(s[3] for s in spans) - min(s[2] for s in spans)))
    return sim.makespan + statistics.median(outside)


def rank_main(args):
    import deepspeed
    import torch
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from megatron_ds.model.moe_dispatch import TEST_LATENCY_ENV
    from megatron_ds.pipe.auto import piece_host
    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.costs import PIECES_MOE, stage_layers

    os.environ[TEST_LATENCY_ENV] = "0"
    config = model_config(args)
    engines = {}
    for name in args.schedules:
        engines[(name, False)] = build(config, args, {"schedule": name})
        engines[(name, True)] = build(config, args, {"schedule": name, "overlap": True})
    first = engines[(args.schedules[0], False)]
    dp_rank, rank0 = first.grid.get_data_parallel_rank(), dist.get_rank() == 0
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, piece_host(first._overlap()))  # the runtime's switching (pipe/auto.py)
    host = statistics.median(hosts)

    data = random_batches(config, {"gas": args.gas, "mbs": args.micro_batch_size, "seq": args.seq_length}, dp_rank)

    def both(name):
        return {k: e for k, e in engines.items() if k[0] == name}

    step = 0
    timed(engines, data, args.warmup, step)  # shapes learned, caches warm
    step += args.warmup
    calib = timed({k: e for k, e in engines.items() if not k[1]}, data, args.calibrate, step)
    step += args.calibrate
    rows = []
    for name in args.schedules:
        plain = engines[(name, False)]
        counted = traced(plain, data, 1, step)
        step += 1
        count = torch.tensor([max(counted.counts)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the busiest rank's all-to-alls per step
        box = [statistics.median(calib[(name, False)])]
        dist.broadcast_object_list(box, src=0)  # rank 0's plain step
        base, n = box[0], int(count.item())
        schedule = plain.plan.schedule
        over = build_schedule(name, args.pp, args.gas, overlap=True)
        per = [PIECES_MOE if config.is_moe_layer(i + 1) else 1 for i in range(config.num_layers)]
        pieces = [sum(per[j] for j in held) for held in stage_layers(config.num_layers, schedule.stages)]
        for share in args.shares:
            latency = share * base / (n * (1 - share))
            os.environ[TEST_LATENCY_ENV] = f"{latency * 1e3:.6f}"
            timed(both(name), data, 1, step)  # the new latency's first iteration, untimed
            step += 1
            # traced and timed iterations alternate, so the simulation's costs and the measured steps come
            # from the same minutes of a noisy machine
            rec, times = Recorder(plain), {k: [] for k in both(name)}
            for i in range(args.iterations):
                if i % max(1, args.iterations // args.traced) == 0:
                    traced(plain, data, 1, step, rec)
                    step += 1
                pair = both(name) if i % 2 == 0 else dict(reversed(both(name).items()))
                for k, v in timed(pair, data, 1, step).items():
                    times[k] += v
                step += 1
            rec = rec.summary()
            rec["dp"] = dp_rank
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, rec)
            if rank0:
                p, o = times[(name, False)], times[(name, True)]
                plain_pred = predict(schedule, records, host, pieces, schedule)
                over_pred = predict(over, records, host, pieces, schedule)
                traced_share = max(statistics.median(r["a2a"]) for r in records) / statistics.median(p)
                slept_share = max(statistics.median(r["sleeps"]) for r in records) / statistics.median(p)
                rows.append(dict(schedule=name, share=share, traced_share=traced_share, slept_share=slept_share, latency=latency, count=n,
                                 plain=statistics.median(p), over=statistics.median(o),
                                 ratio=paired_ratio(o, p),
                                 sim_ratio=over_pred / plain_pred, plain_pred=plain_pred, over_pred=over_pred))
        os.environ[TEST_LATENCY_ENV] = "0"
    return dict(rows=rows, piece_host=host, counts=n, base=base) if rank0 else None


def report(result, args) -> str:
    counts = ", ".join(sorted({f"{r['schedule']} {r['count']}" for r in result["rows"]}))
    lines = [f"MoE GPT {args.num_layers} layers (all MoE, {args.experts} experts top-2, EP 2), hidden "
             f"{args.hidden_size}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, m={args.gas}; "
             f"PP{args.pp} x DP{WORLD_DP}, ZeRO-1 AdamW fp32, gloo, 1 thread a rank; medians of {args.iterations} "
             f"alternated iterations after warm-up; piece host time {result['piece_host'] * 1e3:.3f} ms; all-to-alls "
             f"per step on the busiest rank: {counts}",
             ""]
    lines += table(["schedule", "a2a share: target / slept / traced", "ms per a2a added", "plain (ms)",
                    "overlapped (ms)", "ratio", "sim. ratio", "meas/sim plain", "meas/sim overlapped",
                    "ratio / sim. ratio"], "l" * 10,
                   [[r["schedule"], f"{r['share']:.0%} / {r['slept_share']:.0%} / {r['traced_share']:.0%}",
                     f"{r['latency'] * 1e3:.2f}", f"{r['plain'] * 1e3:.1f}", f"{r['over'] * 1e3:.1f}",
                     f"{r['ratio']:.3f}", f"{r['sim_ratio']:.3f}", f"{r['plain'] / r['plain_pred']:.3f}",
                     f"{r['over'] / r['over_pred']:.3f}", f"{r['ratio'] / r['sim_ratio']:.3f}"] for r in result["rows"]])
    return "\n".join(lines)


def parse(argv=None):
    ap = parser(__doc__, pp=2, gas=16, micro_batch_size=2, seq_length=32, hidden_size=64, num_layers=4,
                num_attention_heads=4, vocab_size=256)
    ap.add_argument("--experts", type=int, default=4, help="experts per MoE layer (even: EP 2 splits them)")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--shares", nargs="+", type=float, default=list(SHARES),
                    help="the all-to-all's share of the plain step to set, each in [0, 1) (0: no latency, the "
                         "runtime's own cost of the overlap)")
    ap.add_argument("--iterations", type=int, default=8, help="timed iterations of each engine per row")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibrate", type=int, default=4, help="iterations timing the plain step without latency")
    ap.add_argument("--traced", type=int, default=4, help="traced plain iterations per row, alternated with the timed "
                                                          "ones (the simulation's costs)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    problems = [f"--shares {s}: each must be in [0, 1)" for s in args.shares if not 0 <= s < 1]
    problems += [f"--{k} {getattr(args, k)}: must be at least 1" for k in ("iterations", "calibrate", "traced")
                 if getattr(args, k) < 1]
    if args.pp != 2:
        problems.append(f"--pp {args.pp}: this bench runs PP2 x DP2 (4 ranks on a small machine)")
    if args.gas < 2 * args.pp:
        problems.append(f"--gas {args.gas}: dualpipev needs at least 2 x PP = {2 * args.pp} micro-batches")
    if args.experts % 2 or args.num_layers % (2 * args.pp):
        problems.append(f"--experts {args.experts} must be even and --num-layers {args.num_layers} a multiple of "
                        f"{2 * args.pp} (dualpipev's chunks)")
    if problems:
        print(f"bench.moe_overlap: {problems[0]}", file=sys.stderr)
        raise SystemExit(2)
    return args


def main(argv=None):
    args = parse(argv)
    machine = Machine()
    result = run_ranks(args.pp * WORLD_DP, rank_main, args, timeout=args.timeout, quiet=True)[0]
    text = emit(f"{report(result, args)}\n\n{machine.before_after()}", args.perf_file, "bench.moe_overlap", argv)
    return result, text


if __name__ == "__main__":
    main()
