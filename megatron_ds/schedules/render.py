"""Pictures of a simulated schedule: ASCII for logs, PNG/SVG timelines via matplotlib.

Labels are Schedule.op_label's: kind and micro-batch (".q" segment when the sequence is
split), one prime per earlier chunk of the same replica on the rank (ZB-V's and BitPipe's
second leg: F3'), lower-case letters for replica 1 of a bidirectional schedule.
"""
from __future__ import annotations

from .ir import Op, Schedule
from .kinds import Kind
from .simulate import SimResult


def ascii_timeline(result: SimResult, width: int | None = None, max_width: int = 400) -> str:
    """One row per rank; an op is '|' + label padded with '-' to its length, idle is ' '."""
    s = result.schedule
    labels = {(r, op): s.op_label(r, op) for r, _, op in s.ops()}
    durations = [result.end[op] - result.start[op] for _, _, op in s.ops()]
    shortest = min((d for d in durations if d > 0), default=1.0)
    t0 = min(result.start.values())
    if width is None:
        # Give the shortest op room for the longest label, within max_width columns.
        per_unit = (max(len(t) for t in labels.values()) + 1) / shortest
        width = min(max_width, max(1, round(result.makespan * per_unit)))
    scale = width / result.makespan if result.makespan > 0 else 1.0
    rows = []
    for r, ops in enumerate(s.ranks):
        cells = [" "] * width
        for op in ops:
            a = round((result.start[op] - t0) * scale)
            b = max(a + 1, round((result.end[op] - t0) * scale))
            text = ("|" + labels[r, op])[: b - a].ljust(b - a, "-")
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


def colour(schedule: Schedule, rank: int, op: Op) -> str:
    """The op kind's colour, darker for later chunks of the replica on the rank."""
    shades = op.kind.traits.colours
    return shades[min(schedule.chunk_index(rank, op), len(shades) - 1)]


def plot_timeline(result: SimResult, path: str, title: str | None = None) -> str:
    """Draw the timeline to `path` (.png or .svg, by extension); returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = result.schedule
    t0 = min(result.start.values())
    fig_w = min(40.0, max(8.0, result.makespan * 0.35))
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * s.pp + 1.6))
    for r, ops in enumerate(s.ranks):
        for op in ops:
            start, end = result.start[op] - t0, result.end[op] - t0
            ax.barh(r, end - start, left=start, height=0.8, color=colour(s, r, op), edgecolor="black",
                    linewidth=0.4, hatch="//" if op.replica == 1 else None)
            text = str(op.mb) + (f".{op.seq}" if s.seq_splits > 1 else "")
            if end - start >= 0.25 * len(text) * result.makespan / (fig_w * 6):
                ax.text((start + end) / 2, r, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    kinds = [k for k in Kind if any(op.kind == k for _, _, op in s.ops())]
    handles = [Patch(color=k.traits.colours[1], label=k) for k in kinds]
    if s.replicas > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="replica 1"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=7,
              ncol=len(handles), frameon=False)
    ax.set_title(title or f"{s.name}: p={s.pp} m={s.micro_batches}"
                 + (f" k={s.seq_splits}" if s.seq_splits > 1 else "")
                 + f"  makespan {result.makespan:g}  bubble {result.bubble_ratio:.3f}"
                 + "  (darker = later chunk on the rank)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
