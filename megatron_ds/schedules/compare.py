"""One table of every schedule's makespan, bubble and memory for the same p, m and costs; and, for a model's
shape at a sequence length, the same at each context-parallel size (`context_rows`: bytes and seconds)."""
from __future__ import annotations

import functools
from typing import Callable

from .catalog import BASELINE, CATALOG, build_schedule
from .context_parallel import ContextRun
from .costs import ModelCosts, evaluate
from .ir import ScheduleError


def compare_rows(pp: int, m: int, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0, *,
                 p2p_latency: float = 0.0, virtual_stages: int = 2, seq_splits=2,
                 act_size=None, embed=(0.0, 0.0, 0.0), head=(0.0, 0.0, 0.0), head_memory: float = 0.0,
                 vocab_parallel: bool = False, seq_costs: Callable[[int], list] | None = None,
                 layers=(), all_to_all=(), layer_memory=()) -> list[dict]:
    """Simulate each schedule (with `vocab_parallel`, each also with the vocabulary passes: "+vocab");
    a refused setting gives a row with its reason. `seq_splits`: Seq1F1B's segment count, or a tuple
    of them; `seq_costs(k)`: the relative costs of k segments (default: equal). Every row's "ideal"
    is its schedule's makespan with the embedding and the head spread evenly (ModelCosts.balanced).
    `layers`, `all_to_all`, `layer_memory`: ModelCosts' per-layer fields (MoE); each row then also has
    "all_to_all", the most time one rank spends in it, and every row "memory", each rank's peak."""
    splits = (seq_splits,) if isinstance(seq_splits, int) else tuple(seq_splits)
    costs = ModelCosts(tf, tb, tw, embed=tuple(embed), head=tuple(head), head_memory=head_memory, layers=tuple(layers),
                       all_to_all=tuple(all_to_all), layer_memory=tuple(layer_memory))
    variants = [(name, kwargs, note) for name, spec in CATALOG.items()
                for note, kwargs in spec.variants(virtual_stages, splits, op_costs=costs.mean_op_times(pp))]
    if vocab_parallel:
        variants = [row for name, kwargs, note in variants for row in
                    ((name, kwargs, note), (name, {**kwargs, "vocab_parallel": True}, f"{note} +vocab".strip()))]
    rows, base, ideal = [], None, {}
    for name, kwargs, note in variants:
        row = {"schedule": name, "setting": note}
        try:
            schedule = _built(name, pp, m, tuple(sorted(kwargs.items())))
            shares = seq_costs(schedule.seq_splits) if seq_costs and schedule.seq_splits > 1 else None
            res = evaluate(schedule, costs, p2p_latency=p2p_latency, act_size=act_size, seq_costs=shares)
            plain = tuple(sorted((k, v) for k, v in kwargs.items() if k != "vocab_parallel"))
            if (name, plain) not in ideal:
                bare = _built(name, pp, m, plain) if schedule.vocab_parallel else schedule
                ideal[(name, plain)] = evaluate(bare, costs.balanced(pp), p2p_latency=p2p_latency,
                                                seq_costs=shares).makespan
        except ScheduleError as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        row.update(makespan=res.makespan, bubble=res.bubble_ratio, peak_memory=res.peak_memory_max,
                   p2p=res.p2p_messages, ideal=ideal[(name, plain)], memory=res.peak_memory,
                   all_to_all=max(res.all_to_all))
        if name == BASELINE and not kwargs.get("vocab_parallel"):
            base = res.makespan
        rows.append(row)
    for row in rows:
        if "makespan" in row and base:
            row["speedup"] = base / row["makespan"]
            row["vs_1f1b"] = row["makespan"] / base  # the table's column: lower is better, as every other one
    return rows


@functools.lru_cache(maxsize=256)  # the vocabulary passes' placement takes seconds at p=8; tables repeat it
def _built(name: str, pp: int, m: int, knobs: tuple):
    return build_schedule(name, pp, m, **dict(knobs))


TIME_VS_1F1B = "time/1f1b (lower is better)"  # docs/PERFORMANCE.md's tables read the same way


def format_table(rows: list[dict], title: str = "") -> str:
    head = (f"{'schedule':<12} {'setting':<15} {'makespan':>9} {'bubble':>7} {'peak_mem':>9} "
            f"{'p2p':>5} {TIME_VS_1F1B:>27}")
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['schedule']:<12} {row['setting']:<15} n/a: {row['error']}")
            continue
        time = f"{row['vs_1f1b']:.3f}" if "vs_1f1b" in row else ""
        lines.append(f"{row['schedule']:<12} {row['setting']:<15} {row['makespan']:>9.2f} "
                     f"{row['bubble']:>7.3f} {row['peak_memory']:>9.2f} {row['p2p']:>5} {time:>27}")
    return "\n".join(lines)


def context_sizes(cp: int) -> list[int]:
    """The CP sizes a table sets side by side: 1, 2, 4, ... up to `cp` when it is a power of two, else 1 and `cp`."""
    if cp & (cp - 1) == 0:
        return [1 << i for i in range(cp.bit_length())]
    return [1, cp]


def context_rows(pp: int, m: int, config, seq: int, cp: int, comm: str = "p2p", *, virtual_stages: int = 2,
                 seq_splits=(2,), seq_split_method: str = "balanced", **run) -> tuple[list[dict], list[dict]]:
    """(one entry per CP size of context_sizes(cp): the attention's messages, the share hidden, a layer's memory and
    times; one row per schedule setting: at each CP size its busiest rank's peak activation memory in bytes and
    its simulated step in seconds, or the reason it cannot run). `run`: ContextRun's other fields."""
    splits = (seq_splits,) if isinstance(seq_splits, int) else tuple(seq_splits)
    sizes, rows = [], {}
    for c in context_sizes(cp):
        model = ContextRun(config, seq, c, comm, **run)
        model.check()
        held, ring = model.layer()
        msgs = model.messages()
        sizes.append({"cp": c, "tokens": seq // c, "held": held.held, "comm": held.comm, "in_flight": held.in_flight,
                      "forward": msgs.forward_bytes, "backward": msgs.backward_bytes, "hidden": ring.hidden,
                      "step_hidden": ring.step_hidden, "compute": ring.compute, "exposed": ring.exposed})
        op_costs = model.model_costs(pp).mean_op_times(pp)
        for name, spec in CATALOG.items():
            for note, kwargs in spec.variants(virtual_stages, splits, op_costs=op_costs):
                row = rows.setdefault((name, note), {"schedule": name, "setting": note, "cp": {}})
                try:
                    lengths = model.segment_lengths(kwargs.get("seq_splits", 1), seq_split_method)
                    schedule = _built(name, pp, m, tuple(sorted({**kwargs, "segment_lengths": tuple(lengths)}.items()
                                                                if lengths else kwargs.items())))
                    res, peak = model.simulate(schedule)
                except ScheduleError as exc:
                    row["cp"][c] = {"error": str(exc)}
                    continue
                row["cp"][c] = {"peak_memory": peak, "makespan": res.makespan}
    return sizes, list(rows.values())


GIB, MIB = 2 ** 30, 2 ** 20


def format_context_table(sizes: list[dict], rows: list[dict], title: str = "") -> str:
    """The CP sizes' attention costs, then each schedule's peak memory per rank (GiB) and step (s) at each size."""
    lines = [title] if title else []
    head = (f"{'CP':>3} {'tokens/rank':>11} {'held GiB/layer':>14} {'sent MiB/layer F/B':>19} {'hidden':>6} "
            f"{'step hides F/B':>14} {'layer ms F/B/W':>20} {'unhidden ms F/B':>15}")
    lines += [head, "-" * len(head)]
    for s in sizes:
        step = "/".join(f"{x:.2f}" for x in s["step_hidden"]) if s["step_hidden"] else "-"
        hidden = f"{s['hidden']:.2f}" if s["cp"] > 1 else "-"
        lines.append(f"{s['cp']:>3} {s['tokens']:>11} {s['held'] / GIB:>14.3f} "
                     f"{s['forward'] / MIB:>9.1f}/{s['backward'] / MIB:<9.1f} {hidden:>6} {step:>14} "
                     f"{'/'.join(f'{t * 1e3:.2f}' for t in s['compute']):>20} "
                     f"{'/'.join(f'{t * 1e3:.2f}' for t in s['exposed']):>15}")
    cps = [s["cp"] for s in sizes]
    lines += ["", "peak activation memory per rank (GiB, busiest rank) and step (s), by CP size"]
    head = f"{'schedule':<12} {'setting':<10}" + "".join(f" {f'CP={c} GiB':>10} {'step s':>8}" for c in cps)
    lines += [head, "-" * len(head)]
    for row in rows:
        cells, errors = "", []
        for c in cps:
            cell = row["cp"][c]
            if "error" in cell:
                cells += f" {'n/a':>10} {'':>8}"
                errors.append(f"CP={c}: {cell['error']}" if len(cps) > 1 else cell["error"])
            else:
                cells += f" {cell['peak_memory'] / GIB:>10.2f} {cell['makespan']:>8.3f}"
        note = f"  n/a: {errors[0]}" if errors else ""
        lines.append(f"{row['schedule']:<12} {row['setting']:<10}{cells}{note}")
    return "\n".join(lines)
