"""Vocabulary parallelism in the simulator: naive placement, partition by cost, vocabulary-parallel.

The model: L transformer layers of equal cost (F = B = W = 1 per layer), an output layer with its
loss costing c layers (F, B and W alike) and an embedding costing c/4 of a layer in all (F 1/3,
its scatter-add backward 2/3): a large vocabulary makes both dear. Three placements per schedule:
- naive: L/S layers per stage, the embedding on stage 0, the head on the last stage (DeepSpeed's
  "type:transformer" cut);
- by cost: the layer cut that balances the busiest rank's cost (pipe/plan/partition.py,
  "partition_method": "costs:[...]");
- vocab: L/S layers per stage, the embedding and the head sliced over the p ranks, their passes
  placed by the schedule ("vocab_parallel": true).
The balanced ideal is the same schedule with the head's and embedding's cost spread evenly over
the ranks at no overhead (ModelCosts.balanced, as bench.layer_costs's "/ ideal"); "vs ideal" is each
iteration's ratio to it.

Memory per rank, in one layer's activations of one micro-batch (A), for a LLaMA-7B-like shape
(h = s = 4096, micro-batch 1, bf16 with fp32 Adam, activations 34 sh bytes per layer): a layer's
parameters, gradient and optimizer state hold STATIC_PER_LAYER A, the head and the embedding c
layers' worth each (V = 12ch, untied), one micro-batch's logits and their fp32 softmax
LOGITS_PER_C * c A. "mem" is the peak (static + activations + logits) of the heaviest and the
lightest rank; "vocab mem" the part the vocabulary layers hold (their parameters and the peak of
logits held), heaviest over lightest rank: 1F1B-style schedules hold p micro-batches on rank 0
and 1 on the last, whatever the vocabulary does, so that part is the one vocabulary parallelism
balances.

    python -m bench.vocab_parallel [--layers 32] [--pp 4 8] [--heads 1 3 6]
"""
from __future__ import annotations

from dataclasses import dataclass

from bench import harness
from megatron_ds.pipe.plan.partition import balanced_bounds
from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.costs import ModelCosts, evaluate

SCHEDULES = {"1f1b": {}, "interleaved": {"virtual_stages": 2}, "zb-h1": {}, "zbv": {}, "zbv-half": {},
             "seq1f1b": {"seq_splits": 2}}
STATIC_PER_LAYER = 192 / 34      # 16 bytes x 12h^2 parameters over 34 s h bytes, at h = s
LOGITS_PER_C = 6 * 12 / 34       # (2 + 4) bytes x V = 12ch logits per token over 34 h bytes
EMBED_SHARE = 0.25               # the embedding's cost as a share of the head's


@dataclass
class Placement:
    makespan: float
    peak: list          # per rank: static + activations + logits
    vocab_peak: list    # per rank: the vocabulary layers' static + logits


def run(name: str, pp: int, m: int, head: float, layers: int, schedules: dict | None = None) -> dict:
    """The four placements of one schedule: {"naive", "cost", "vocab", "ideal"} -> Placement."""
    kw = SCHEDULES[name]
    base = (schedules or {}).get((name, pp, m)) or build_schedule(name, pp, m, **kw)
    vocab = (schedules or {}).get((name, pp, m, "vocab")) or build_schedule(name, pp, m, vocab_parallel=True, **kw)
    stages = base.stages
    embed = (EMBED_SHARE * head / 3, 0.0, 2 * EMBED_SHARE * head / 3)
    even = [layers / stages] * stages
    out = {"naive": _simulate(base, even, head, embed, vocab_layers=False),
           "vocab": _simulate(vocab, even, head, embed, vocab_layers=True)}
    weights = [sum(embed)] + [3.0] * layers + [0.0, 3.0 * head]   # [embedding, layers, norm, head], F+B+W
    bounds = balanced_bounds(weights, base.placement)
    cut = [len(range(max(a, 1), min(b, layers + 1))) for a, b in zip(bounds, bounds[1:])]
    out["cost"] = _simulate(base, cut, head, embed, vocab_layers=False)
    per_rank = layers / pp   # one 1F1B stage's F, B and W, in one layer's F
    model = ModelCosts(per_rank, per_rank, per_rank, embed=embed, head=(head,) * 3)
    out["ideal"] = Placement(evaluate(base, model.balanced(pp), check=False).makespan, [], [])
    return out


def _simulate(schedule, cut: list, head: float, embed: tuple, vocab_layers: bool) -> Placement:
    """Simulate with `cut[s]` layers on stage s (the embedding and head on the end stages unless
    `vocab_layers`), in units of one layer's F; memory in A."""
    pp = schedule.pp
    costs = []
    for i in range(3):
        per = [float(n) for n in cut]
        if not vocab_layers:
            per[0] += embed[i]
            per[-1] += head
        costs.append(per)
    share = 1.0 / schedule.seq_splits
    act = lambda op: (cut[op.stage] * share, cut[op.stage] * share / 2)  # noqa: E731
    kwargs = {"head": (head,) * 3, "embed": embed} if vocab_layers else {}
    logits = LOGITS_PER_C * head
    res = simulate(schedule, *costs, act_size=act, head_memory=logits, check=False, **kwargs)
    # What the logits alone hold at their peak, per rank: the same simulation without activations.
    held = simulate(schedule, *costs, act_size=(0.0, 0.0), head_memory=logits, check=False, **kwargs).peak_memory
    static = [0.0] * pp
    vocab_static = [0.0] * pp
    for row in schedule.placement:
        for s, r in enumerate(row):
            static[r] += STATIC_PER_LAYER * cut[s]
    for r in range(pp):
        if vocab_layers:
            vocab_static[r] = 2 * head * STATIC_PER_LAYER / pp
        else:
            vocab_static[r] = head * STATIC_PER_LAYER * (
                (schedule.rank_of(0, 0) == r) + (schedule.rank_of(0, schedule.loss_stage) == r))
    peak = [static[r] + vocab_static[r] + res.peak_memory[r] for r in range(pp)]
    return Placement(res.makespan, peak, [vocab_static[r] + held[r] for r in range(pp)])


def build_all(pps, layers: int) -> dict:
    """Every schedule built once per (name, p, m), with and without the vocabulary passes."""
    out = {}
    for pp in pps:
        for m in (2 * pp, 4 * pp):
            for name, kw in SCHEDULES.items():
                out[(name, pp, m)] = build_schedule(name, pp, m, **kw)
                out[(name, pp, m, "vocab")] = build_schedule(name, pp, m, vocab_parallel=True, **kw)
    return out


def _spread(values: list) -> float:
    return max(values) / min(values)


def table(pps=(4, 8), heads=(1, 3, 6), layers: int = 32) -> list:
    built, rows = build_all(pps, layers), []
    for pp in pps:
        for m in (2 * pp, 4 * pp):
            for c in heads:
                for name in SCHEDULES:
                    r = run(name, pp, m, c, layers, built)
                    n, k, v, i = (r[x] for x in ("naive", "cost", "vocab", "ideal"))
                    rows.append([name, pp, m, f"{c:g}", *(f"{x.makespan:.1f}" for x in (n, k, v, i)),
                                 *(f"{a.makespan / b.makespan:.3f}" for a, b in ((n, v), (k, v), (v, i))),
                                 *(f"{max(x.peak):.1f}" for x in (n, k, v)), *(f"{_spread(x.peak):.2f}" for x in (n, k, v)),
                                 f"{max(n.vocab_peak):.1f}", f"{max(v.vocab_peak):.1f}", f"{_spread(v.vocab_peak):.3f}"])
    return harness.table(["schedule", "p", "m", "c", "naive", "by cost", "vocab", "ideal", "naive/v", "cost/v",
                          "v/ideal", "max mem: naive", "max mem: cost", "max mem: vocab", "max/min: naive",
                          "max/min: cost", "max/min: vocab", "vocab part: naive", "vocab part: vocab",
                          "vocab part: max/min"], "l" + "r" * 19, rows)


def main(argv=None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--heads", type=float, nargs="+", default=[1, 3, 6], help="head + loss cost, in layers")
    args = ap.parse_args(argv)
    out = harness.Report(args.perf_file, "bench.vocab_parallel", argv)
    out(f"L={args.layers} layers, F=B=W=1 per layer; head = c layers; embedding = c/4 layers; "
        "times in one layer's F, memory in one layer's activations of one micro-batch",
        *table(tuple(args.pp), tuple(args.heads), args.layers))
    out.save()


if __name__ == "__main__":
    main()
