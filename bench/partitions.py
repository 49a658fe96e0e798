"""Layer partitions compared in the simulator: DeepSpeed's default cut against the cost-balanced ones.

For a model of pretrain_gpt.py's sizes (--hidden-size, --num-layers, --vocab-size, the family
flags), each schedule is cut three ways - "type:transformer" (DeepSpeed's default: equal
transformer-layer counts, the embedding joins the first stage, norm and head the last),
"flops" and, with --costs FILE (bench/layer_costs.py --costs-out), "costs:FILE" - and simulated
with every stage's F, B and W proportional to its layers' costs (B = W = F, the head's too).
Columns: the transformer layers of each stage, the busiest rank's work in layers, the
simulated iteration in units of one layer's F, and its ratio to the default cut's.

    python -m bench.partitions --hidden-size 1024 --num-layers 32 --vocab-size 50304 --seq-length 2048 \\
        --num-attention-heads 16 --num-key-value-heads 4 --swiglu --pp 4 --micro-batches 8
"""
from __future__ import annotations

from types import SimpleNamespace

from bench import harness
from megatron_ds.pipe.plan.partition import cost_bounds, layer_costs, layer_flops
from megatron_ds.schedules import build_schedule, simulate

SCHEDULES = ("1f1b", "zb-h2", "zbv", "zbv-half", "dualpipev")


def default_cut(num_layers: int, stages: int) -> list[int]:
    """DeepSpeed's "type:transformer" bounds over [embedding, layers, norm, head]."""
    from deepspeed.runtime.utils import partition_balanced
    return [int(b) for b in partition_balanced([0] + [1] * num_layers + [0, 0], stages)]


def evaluate(schedule, weights, bounds):
    """(layers per stage, busiest rank's work, simulated makespan) of one cut."""
    stage = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
    ranks = [0.0] * schedule.pp
    for row in schedule.placement:
        for s, r in enumerate(row):
            ranks[r] += stage[s]
    layers = [len(range(max(a, 1), min(b, len(weights) - 2))) for a, b in zip(bounds, bounds[1:])]
    return layers, max(ranks) / len(schedule.placement), simulate(schedule, stage, stage, stage).makespan


def main(argv=None):
    ap = harness.parser(__doc__, hidden_size=1024, num_layers=32, vocab_size=50304, seq_length=2048,
                        num_attention_heads=16, pp=4)
    for flag, default in (("--num-key-value-heads", 0), ("--ffn-hidden-size", 0), ("--micro-batches", 8)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--costs", help="a bench/layer_costs.py --costs-out file: adds a costs:FILE cut")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    args = ap.parse_args(argv)
    ffn = args.ffn_hidden_size or (max(64, int(4 * args.hidden_size * 2 / 3) // 64 * 64) if args.swiglu
                                   else 4 * args.hidden_size)
    config = SimpleNamespace(hidden_size=args.hidden_size, num_layers=args.num_layers, vocab_size=args.vocab_size,
                             max_position_embeddings=args.seq_length, num_attention_heads=args.num_attention_heads,
                             num_key_value_heads=args.num_key_value_heads, ffn_hidden_size=ffn, swiglu=args.swiglu)
    flops = layer_flops(config)
    weights = [w / flops[1] for w in flops]  # one transformer layer = 1
    if args.costs:
        measured = layer_costs(f"costs:{args.costs}", config, len(flops))
        weights = [w / measured[1] for w in measured]  # the cut is judged by what was measured
    out = harness.Report(args.perf_file, "bench.partitions", argv)
    out(f"h={args.hidden_size} L={args.num_layers} V={args.vocab_size} s={args.seq_length} ffn={ffn}"
          f"{' swiglu' if args.swiglu else ''}: head = {weights[-1]:.2f} layers, embedding = {weights[0]:.3f}; "
          f"p={args.pp} m={args.micro_batches}; costs from {'--costs ' + args.costs if args.costs else 'FLOPs'}", "")
    rows = []
    for name in args.schedules:
        schedule = build_schedule(name, args.pp, args.micro_batches)
        cuts = {"type:transformer": default_cut(args.num_layers, schedule.stages),
                "flops": cost_bounds("flops", config, schedule.placement)}
        if args.costs:
            cuts["costs:FILE"] = cost_bounds(f"costs:{args.costs}", config, schedule.placement)
        base = None
        for method, bounds in cuts.items():
            layers, busiest, makespan = evaluate(schedule, weights, bounds)
            base = base or makespan
            rows.append([name, method, " ".join(map(str, layers)), f"{busiest:.2f}", f"{makespan:.1f}",
                         f"{makespan / base:.3f}"])
    out(*harness.table(["schedule", "cut", "transformer layers per stage", "busiest rank (layers)", "iteration",
                        "/ default"], "lllrrr", rows))
    out.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
