"""Merge the ranks' op traces of one iteration and draw the measured timeline above the simulated one.

The traces come from a run with `"pipeline": {"trace_dir": DIR}` in its ds_config (one
Chrome trace per rank and iteration, see megatron_ds/pipe/trace.py). The simulated timeline
is megatron_ds.schedules.simulate on the very op order the ranks ran, with costs TF, TB, TW
per 1F1B stage (milliseconds; by default the measured medians), so the two pictures differ
exactly by what the run added to the schedule: engine overhead, communication and noise.

    python tools/trace_to_png.py runs/trace --out timeline.png --merged merged.json
    python tools/trace_to_png.py runs/trace --step 5 --tf 60 --tb 60 --tw 60 --out zbv.svg
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.schedules import Op, ScheduleError, simulate  # noqa: E402
from megatron_ds.schedules.render import _COLOURS  # noqa: E402
from megatron_ds.pipe.trace import load_iteration, measure, median_costs, merge, to_schedule  # noqa: E402

P2P_COLOUR, STEP_COLOUR = "#bdbdbd", "#636363"


def _shade(schedule, rank, op):
    mine = sorted(st for rep, st in schedule.chunks_on(rank) if rep == op.replica)
    index = mine.index(op.stage) if op.stage in mine else 0
    return _COLOURS[op.kind][min(index, 3)]


def _bar(ax, row, start, end, colour, height=0.8, hatch=None, text=None, min_text=0.0):
    ax.barh(row, end - start, left=start, height=height, color=colour, edgecolor="black", linewidth=0.3,
            hatch=hatch)
    if text and end - start >= min_text * len(text):
        ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=6)


def draw(traces, sim, path, title=None):
    """Measured (top, every rank, p2p waits and steps as thin bars) over simulated (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sched = to_schedule(traces)
    measured = measure(traces)
    t0 = min(e["ts"] for t in traces for e in t.events)
    ms = 1e3
    right = max(measured.span, sim.makespan) * ms
    rows = len(traces)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(min(18.0, max(10.0, right / 150)),
                                                                   0.5 * (rows + sched.pp) + 2.4),
                                      gridspec_kw={"height_ratios": [rows + 1, sched.pp + 1]})
    min_text = right / 900
    for row, t in enumerate(traces):
        stage = t.meta["stage_id"]
        for e in t.events:
            a, b = (e["ts"] - t0) * ms, (e["ts"] + e["dur"] - t0) * ms
            if e["cat"] == "compute":
                args = e["args"]
                op = Op(args["kind"], args["replica"], args["stage"], args["mb"], args["seq"])
                _bar(top, row, a, b, _shade(sched, stage, op), hatch="//" if op.replica else None,
                     text=e["name"].rstrip("'"), min_text=min_text)
            elif e["cat"] == "p2p":
                _bar(top, row + 0.3, a, b, P2P_COLOUR, height=0.2)
            else:
                _bar(top, row + 0.3, a, b, STEP_COLOUR, height=0.2)
    top.set_yticks(range(rows), [f"rank {t.rank}" for t in traces])
    top.invert_yaxis()
    top.set_title(title or (f"{sched.name}: p={sched.pp} m={sched.micro_batches}  measured: iteration "
                            f"{measured.span * ms:.0f} ms, compute makespan {measured.makespan * ms:.0f} ms, "
                            f"bubble {measured.bubble_ratio:.3f}"), fontsize=9)
    s0 = min(sim.start.values())
    for r, ops in enumerate(sched.ranks):
        for op in ops:
            a, b = (sim.start[op] - s0) * ms, (sim.end[op] - s0) * ms
            _bar(bottom, r, a, b, _shade(sched, r, op), hatch="//" if op.replica else None,
                 text=sched.op_label(r, op).rstrip("'"), min_text=min_text)
    bottom.set_yticks(range(sched.pp), [f"rank {r}" for r in range(sched.pp)])
    bottom.invert_yaxis()
    bottom.set_title(f"simulated, same op order: makespan {sim.makespan * ms:.0f} ms, bubble {sim.bubble_ratio:.3f}",
                     fontsize=9)
    bottom.set_xlim(0, right)
    bottom.set_xlabel("ms")
    kinds = sorted({op.kind for ops in sched.ranks for op in ops}, key=["F", "B", "W", "BW"].index)
    handles = [Patch(color=_COLOURS[k][1], label=k) for k in kinds]
    handles += [Patch(color=P2P_COLOUR, label="p2p wait"), Patch(color=STEP_COLOUR, label="load/reduce/step")]
    if sched.replicas > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="replica 1"))
    bottom.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=7,
                  ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
        draw(traces, sim, path, args.title)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
