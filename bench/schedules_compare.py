"""Simulated makespan, bubble ratio and peak activation memory of every schedule.

Prints the `python -m megatron_ds.schedules compare` table for p in {4, 8} and
m in {p, 2p, 4p}, for TF:TB:TW = 1:1:1 and 1:1:0.5 (pure simulation, no GPU).
Memory is in micro-batch activations of one 1F1B stage (W keeps half of them).

    python -m bench.schedules_compare [--p2p-latency 0.05] [--seq-splits 4]
"""
from __future__ import annotations

from bench import harness
from megatron_ds.schedules.compare import compare_rows, format_table


def main(argv=None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--p2p-latency", type=float, default=0.0)
    ap.add_argument("--virtual-stages", type=int, default=2)
    ap.add_argument("--seq-splits", type=int, default=2)
    args = ap.parse_args(argv)
    out = harness.Report(args.perf_file, "bench.schedules_compare", argv)
    for costs in [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5)]:
        for p in (4, 8):
            for m in (p, 2 * p, 4 * p):
                rows = compare_rows(p, m, *costs, p2p_latency=args.p2p_latency,
                                    virtual_stages=args.virtual_stages, seq_splits=args.seq_splits)
                title = (f"p={p} m={m} TF:TB:TW={costs[0]:g}:{costs[1]:g}:{costs[2]:g} "
                         f"p2p={args.p2p_latency:g}")
                out(format_table(rows, title), "")
    out.save()


if __name__ == "__main__":
    main()
