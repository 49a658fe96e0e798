"""Draw a pipeline schedule's simulated timeline (PNG and/or SVG) and print its ASCII form.

    python tools/visualize_schedule.py --schedule bitpipe --pp 4 --micro-batches 8 \
        --tf 1 --tb 1 --tw 1 --out bitpipe.png --out bitpipe.svg
    python tools/visualize_schedule.py --from-json schedule.json --out schedule.svg
"""
from __future__ import annotations

import argparse
import sys

from megatron_ds.schedules import CATALOG, Schedule, ScheduleError, build_schedule, simulate
from megatron_ds.schedules.render import ascii_timeline, plot_timeline, summary_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule", choices=list(CATALOG))
    src.add_argument("--from-json", help="a file written by `python -m megatron_ds.schedules export`")
    ap.add_argument("--pp", type=int)
    ap.add_argument("--micro-batches", type=int)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--seq-splits", type=int, default=1)
    ap.add_argument("--split-backward", action="store_true")
    ap.add_argument("--tf", type=float, default=1.0)
    ap.add_argument("--tb", type=float, default=1.0)
    ap.add_argument("--tw", type=float, default=1.0)
    ap.add_argument("--p2p-latency", type=float, default=0.0)
    ap.add_argument("--out", action="append", required=True,
                    help="picture to write, .png or .svg (repeat for both)")
    ap.add_argument("--quiet", action="store_true", help="do not print the ASCII timeline")
    args = ap.parse_args(argv)
    try:
        if args.from_json:
            with open(args.from_json) as fh:
                schedule = Schedule.from_json(fh.read())
        else:
            if args.pp is None or args.micro_batches is None:
                raise ScheduleError("--schedule needs --pp and --micro-batches")
            schedule = build_schedule(args.schedule, args.pp, args.micro_batches,
                                      virtual_stages=args.virtual_stages,
                                      seq_splits=args.seq_splits,
                                      split_backward=args.split_backward)
        for path in args.out:
            if not path.endswith((".png", ".svg")):
                raise ScheduleError(f"--out {path}: the picture must end in .png or .svg")
        result = simulate(schedule, args.tf, args.tb, args.tw, p2p_latency=args.p2p_latency)
    except (ScheduleError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in args.out:
        plot_timeline(result, path)
        print(f"wrote {path}")
    if not args.quiet:
        print(ascii_timeline(result))
        print(summary_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
