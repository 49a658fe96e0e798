"""Merge the ranks' op traces of one iteration and draw the measured timeline above the simulated one.

The traces come from a run with `"pipeline": {"trace_dir": DIR}` in its ds_config (one
Chrome trace per rank and iteration, see megatron_ds/pipe/trace.py; read by
megatron_ds/schedules/timeline.py, drawn by megatron_ds/schedules/render.py). The simulated timeline
is megatron_ds.schedules.simulate on the very op order the ranks ran, with costs TF, TB, TW
per 1F1B stage (milliseconds; by default the measured medians), so the two pictures differ
exactly by what the run added to the schedule: engine overhead, communication and noise.

    python tools/trace_to_png.py runs/trace --out timeline.png --merged merged.json
    python tools/trace_to_png.py runs/trace --step 5 --tf 60 --tb 60 --tw 60 --out zbv.svg
"""
from __future__ import annotations

import argparse
import json
import sys

from megatron_ds.schedules import ScheduleError, simulate
from megatron_ds.schedules.render import plot_measured
from megatron_ds.schedules.timeline import load_iteration, measure, median_costs, merge, to_schedule


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--step", type=int, help="iteration to draw (default: the last one traced)")
    ap.add_argument("--out", action="append", default=[], help="picture, .png or .svg (repeat for both)")
    ap.add_argument("--merged", help="also write all ranks as one Chrome/Perfetto trace JSON")
    ap.add_argument("--tf", type=float, help="forward ms per 1F1B stage for the simulation (default: measured)")
    ap.add_argument("--tb", type=float, help="input-gradient backward ms (default: measured)")
    ap.add_argument("--tw", type=float, help="weight-gradient ms (default: measured)")
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    try:
        traces = load_iteration(args.trace_dir, args.step)
        for path in args.out:
            if not path.endswith((".png", ".svg")):
                raise ScheduleError(f"--out {path}: the picture must end in .png or .svg")
        med = median_costs(traces)
        tb = args.tb / 1e3 if args.tb is not None else med.get("B", med.get("BW", 0.0) / 2)
        tw = args.tw / 1e3 if args.tw is not None else med.get("W", med.get("BW", 0.0) - tb)
        tf = args.tf / 1e3 if args.tf is not None else med["F"]
        sim = simulate(to_schedule(traces), tf, tb, tw)
    except (OSError, ScheduleError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = measure(traces)
    print(f"{traces[0].meta['schedule']} p={traces[0].meta['pp']} m={traces[0].meta['micro_batches']} "
          f"step {traces[0].meta['step']}: measured iteration {m.span * 1e3:.1f} ms, compute makespan "
          f"{m.makespan * 1e3:.1f} ms, bubble {m.bubble_ratio:.3f} (per rank "
          f"{', '.join(f'{b:.3f}' for b in m.bubble)}); simulated makespan {sim.makespan * 1e3:.1f} ms "
          f"(TF {tf * 1e3:.1f}, TB {tb * 1e3:.1f}, TW {tw * 1e3:.1f} ms), bubble {sim.bubble_ratio:.3f}; "
          f"measured/simulated {m.makespan / sim.makespan:.3f}")
    if args.merged:
        with open(args.merged, "w") as fh:
            json.dump(merge(traces), fh)
        print(f"wrote {args.merged}")
    for path in args.out:
        plot_measured(traces, sim, path, args.title)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
