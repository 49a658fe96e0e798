"""Every picture of a schedule: ASCII for logs, PNG/SVG timelines via matplotlib (simulated, and a
traced run's measured timeline over its simulation). Colours come from the op kinds' table
(kinds.py), one shade per chunk of the replica on the rank (Schedule.chunk_index).

Labels are Schedule.op_label's: kind and micro-batch (".q" segment when the sequence is
split), one prime per earlier chunk of the same replica on the rank (ZB-V's and BitPipe's
second leg: F3'), lower-case letters for replica 1 of a bidirectional schedule. An overlapped
unit (Schedule.overlap) is one ASCII bar labelled "F7+BW3'", and in the pictures its forward
fills the upper half of the rank's row and its backward the lower half, over the unit's span.
"""
from __future__ import annotations

from .ir import Op, Schedule
from .kinds import Kind
from .simulate import SimResult
from .timeline import RankTrace, measure, op_of, to_schedule


def ascii_timeline(result: SimResult, width: int | None = None, max_width: int = 400) -> str:
    """One row per rank; an op is '|' + label padded with '-' to its length, idle is ' '; an overlapped
    unit is one bar labelled with both ops ("F7+BW3'")."""
    s = result.schedule
    units = [s.units(r) for r in range(s.pp)]
    labels = {(r, unit): "+".join(s.op_label(r, op) for op in unit) for r in range(s.pp) for unit in units[r]}
    durations = [result.end[op] - result.start[op] for _, _, op in s.ops()]
    shortest = min((d for d in durations if d > 0), default=1.0)
    t0 = min(result.start.values())
    if width is None:
        # Give the shortest op room for the longest label, within max_width columns.
        per_unit = (max(len(t) for t in labels.values()) + 1) / shortest
        width = min(max_width, max(1, round(result.makespan * per_unit)))
    scale = width / result.makespan if result.makespan > 0 else 1.0
    rows = []
    for r in range(s.pp):
        cells = [" "] * width
        for unit in units[r]:
            a = round((result.start[unit[0]] - t0) * scale)
            b = max(a + 1, round((result.end[unit[0]] - t0) * scale))
            text = ("|" + labels[r, unit])[: b - a].ljust(b - a, "-")
            cells[a:b] = list(text)
        rows.append(f"rank{r:<3d}" + "".join(cells[:width]).rstrip())
    return "\n".join(rows)


def summary_table(result: SimResult) -> str:
    lines = [f"{'rank':>4} {'busy':>9} {'bubble':>7} {'own':>7} {'peak_mem':>9} {'sent':>5}"]
    for r in range(result.schedule.pp):
        lines.append(f"{r:>4} {result.busy[r]:>9.3f} {result.bubble[r]:>7.3f} "
                     f"{result.own_bubble[r]:>7.3f} {result.peak_memory[r]:>9.3f} "
                     f"{result.p2p_sent[r]:>5}")
    lines.append(f"makespan {result.makespan:.3f}, bubble ratio {result.bubble_ratio:.3f} (max over "
                 f"ranks, whole iteration), peak activation memory {result.peak_memory_max:.3f}, "
                 f"p2p messages {result.p2p_messages}")
    return "\n".join(lines)


P2P_COLOUR, STEP_COLOUR = "#bdbdbd", "#636363"   # measured p2p waits; loading, reductions, optimizer step


def colour(schedule: Schedule, rank: int, op: Op) -> str:
    """The op kind's colour, darker for later chunks of the replica on the rank."""
    shades = op.kind.traits.colours
    return shades[min(schedule.chunk_index(rank, op), len(shades) - 1)]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bar(ax, row, start, end, fill, *, height=0.8, hatch=None, text=None, min_text=0.0, fontsize=7):
    """One op (or wait) as a bar; its text only where `min_text` per character fits."""
    ax.barh(row, end - start, left=start, height=height, color=fill, edgecolor="black", linewidth=0.4,
            hatch=hatch)
    if text and end - start >= min_text * len(text):
        ax.text((start + end) / 2, row, text, ha="center", va="center", fontsize=fontsize)


def _op_bar(ax, schedule, rank, op, start, end, text, min_text, fontsize=7, half=0):
    """An op's bar on the rank's row; `half` -1 or 1: the upper or lower half of the row (an overlapped unit
    draws its forward above its backward over the unit's span)."""
    _bar(ax, rank + 0.2 * half, start, end, colour(schedule, rank, op), height=0.4 if half else 0.8,
         hatch="//" if op.replica == 1 else None, text=text, min_text=min_text, fontsize=fontsize)


def halves(schedule: Schedule, rank: int) -> dict:
    """op -> -1 (upper half) or 1 (lower) for the ops of `rank`'s overlapped units: the forward above."""
    out = {}
    for unit in schedule.units(rank):
        if len(unit) == 2:
            for op in unit:
                out[op] = -1 if op.kind is Kind.F else 1
    return out


def _legend(fig, schedule, extra=()):
    """A key for the op kinds the schedule uses, `extra` (label, colour) pairs, and replica 1's hatch, in a
    row of its own under the time axis's label (the figure's constrained layout makes room for it)."""
    from matplotlib.patches import Patch
    kinds = [k for k in Kind if any(op.kind == k for _, _, op in schedule.ops())]
    handles = [Patch(color=k.traits.colours[1], label=k) for k in kinds]
    handles += [Patch(color=fill, label=label) for label, fill in extra]
    if schedule.replicas > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="replica 1"))
    fig.legend(handles=handles, loc="outside lower center", fontsize=7, ncol=len(handles), frameon=False)


def _rank_axis(ax, labels):
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()


def plot_timeline(result: SimResult, path: str, title: str | None = None) -> str:
    """Draw the simulated timeline to `path` (.png or .svg, by extension); returns the path."""
    plt = _pyplot()
    s = result.schedule
    t0 = min(result.start.values())
    fig_w = min(40.0, max(8.0, result.makespan * 0.35))
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * s.pp + 1.6), layout="constrained")
    min_text = 0.25 * result.makespan / (fig_w * 6)
    for r, ops in enumerate(s.ranks):
        half = halves(s, r)
        for op in ops:
            text = str(op.mb) + (f".{op.seq}" if s.seq_splits > 1 else "")
            _op_bar(ax, s, r, op, result.start[op] - t0, result.end[op] - t0, text, min_text, half=half.get(op, 0))
    _rank_axis(ax, [f"rank {r}" for r in range(s.pp)])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    _legend(fig, s)
    ax.set_title(title or f"{s.name}: p={s.pp} m={s.micro_batches}"
                 + (f" k={s.seq_splits}" if s.seq_splits > 1 else "")
                 + f"  makespan {result.makespan:g}  bubble {result.bubble_ratio:.3f}"
                 + "  (darker = later chunk on the rank" + ("; half bars: F&B unit" if s.overlap else "")
                 + ")")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_measured(traces: list[RankTrace], sim: SimResult, path: str, title: str | None = None) -> str:
    """A traced iteration (top: every rank, p2p waits and step work as thin bars) over the simulation
    of the same op order (bottom), in milliseconds; `traces` as timeline.load_iteration gives them."""
    plt = _pyplot()
    sched = to_schedule(traces)
    measured = measure(traces)
    t0 = min(e["ts"] for t in traces for e in t.events)
    ms = 1e3
    right = max(measured.span, sim.makespan) * ms
    rows = len(traces)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(min(18.0, max(10.0, right / 150)),
                                                                   0.5 * (rows + sched.pp) + 2.4),
                                      gridspec_kw={"height_ratios": [rows + 1, sched.pp + 1]}, layout="constrained")
    min_text = right / 900
    for row, t in enumerate(traces):
        for e in t.events:
            a, b = (e["ts"] - t0) * ms, (e["ts"] + e["dur"] - t0) * ms
            if e["cat"] == "compute":
                op = op_of(e)
                stage_id = t.meta["stage_id"]
                half = (-1 if op.kind is Kind.F else 1) if e["args"].get("overlapped") else 0
                _bar(top, row + 0.2 * half, a, b, colour(sched, stage_id, op), hatch="//" if op.replica else None,
                     height=0.4 if half else 0.8, text=e["name"].rstrip("'"), min_text=min_text, fontsize=6)
            else:
                _bar(top, row + 0.3, a, b, P2P_COLOUR if e["cat"] == "p2p" else STEP_COLOUR, height=0.2)
    _rank_axis(top, [f"rank {t.rank}" for t in traces])
    top.set_title(title or (f"{sched.name}: p={sched.pp} m={sched.micro_batches}  measured: iteration "
                            f"{measured.span * ms:.0f} ms, compute makespan {measured.makespan * ms:.0f} ms, "
                            f"bubble {measured.bubble_ratio:.3f}"), fontsize=9)
    s0 = min(sim.start.values())
    for r, ops in enumerate(sched.ranks):
        half = halves(sched, r)
        for op in ops:
            _op_bar(bottom, sched, r, op, (sim.start[op] - s0) * ms, (sim.end[op] - s0) * ms,
                    sched.op_label(r, op).rstrip("'"), min_text, fontsize=6, half=half.get(op, 0))
    _rank_axis(bottom, [f"rank {r}" for r in range(sched.pp)])
    bottom.set_title(f"simulated, same op order: makespan {sim.makespan * ms:.0f} ms, bubble {sim.bubble_ratio:.3f}",
                     fontsize=9)
    bottom.set_xlim(0, right)
    bottom.set_xlabel("ms")
    _legend(fig, sched, [("p2p wait", P2P_COLOUR), ("load/reduce/step", STEP_COLOUR)])
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
