"""One table of every schedule's makespan, bubble and memory for the same p, m and costs."""
from __future__ import annotations

from .catalog import BASELINE, CATALOG, build_schedule
from .costs import ModelCosts, evaluate
from .ir import ScheduleError


def compare_rows(pp: int, m: int, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0, *,
                 p2p_latency: float = 0.0, virtual_stages: int = 2, seq_splits: int = 2,
                 act_size=None, embed=(0.0, 0.0, 0.0), head=(0.0, 0.0, 0.0), head_memory: float = 0.0,
                 vocab_parallel: bool = False) -> list[dict]:
    """Simulate each schedule (with `vocab_parallel`, each also with the vocabulary passes: "+vocab");
    a refused setting gives a row with its reason."""
    variants = [(name, kwargs, note) for name, spec in CATALOG.items()
                for note, kwargs in spec.variants(virtual_stages, (seq_splits,), op_costs=(tf, tb, tw))]
    if vocab_parallel:
        variants = [row for name, kwargs, note in variants for row in
                    ((name, kwargs, note), (name, {**kwargs, "vocab_parallel": True}, f"{note} +vocab".strip()))]
    costs = ModelCosts(tf, tb, tw, embed=tuple(embed), head=tuple(head), head_memory=head_memory)
    rows, base = [], None
    for name, kwargs, note in variants:
        row = {"schedule": name, "setting": note}
        try:
            res = evaluate(build_schedule(name, pp, m, **kwargs), costs,
                           p2p_latency=p2p_latency, act_size=act_size)
        except ScheduleError as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        row.update(makespan=res.makespan, bubble=res.bubble_ratio, peak_memory=res.peak_memory_max,
                   p2p=res.p2p_messages)
        if name == BASELINE and not kwargs.get("vocab_parallel"):
            base = res.makespan
        rows.append(row)
    for row in rows:
        if "makespan" in row and base:
            row["speedup"] = base / row["makespan"]
    return rows


def format_table(rows: list[dict], title: str = "") -> str:
    head = (f"{'schedule':<12} {'setting':<15} {'makespan':>9} {'bubble':>7} {'peak_mem':>9} "
            f"{'p2p':>5} {'vs 1f1b':>8}")
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['schedule']:<12} {row['setting']:<15} n/a: {row['error']}")
            continue
        speed = f"{row['speedup']:.3f}x" if "speedup" in row else ""
        lines.append(f"{row['schedule']:<12} {row['setting']:<15} {row['makespan']:>9.2f} "
                     f"{row['bubble']:>7.3f} {row['peak_memory']:>9.2f} {row['p2p']:>5} {speed:>8}")
    return "\n".join(lines)
