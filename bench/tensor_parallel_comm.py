"""Tensor-parallel communication per transformer layer per micro-batch: counted vs Megatron's formulas.

Runs one GPT-2 TransformerLayer split over TP gloo ranks (tensor_model_parallel_size),
counts every collective its layers issue (CommCounter) in the forward and the
backward, and prints them beside the formulas of Megatron's papers (bytes of the full
b x s x h activation per collective, fp32 here):

  without sequence parallelism: forward 2 all-reduces (after the attention and MLP
    row-parallel linears), backward 2 all-reduces (before the two column-parallel ones);
  with sequence parallelism: forward 2 all-gathers + 2 reduce-scatters, backward
    2 all-gathers + 2 reduce-scatters, plus 2 all-gathers that re-gather the column-parallel
    inputs for their weight gradients (Megatron saves only the sequence shard).

An all-reduce moves about twice an all-gather's bytes per rank (ring: 2(t-1)/t vs (t-1)/t
of the tensor), so both variants move the same volume. Prints a table; never a timed test.

  python -m bench.tensor_parallel_comm [--tp 2 4] [--batch 2 --seq 16 --hidden 64 --heads 8]
"""
from __future__ import annotations

import sys

import torch

from bench import harness
from megatron_ds.model import GPTConfig, TransformerLayer
from megatron_ds.model.tensor_parallel import CommCounter, initialize_model_parallel
from megatron_ds.testing.launcher import run_ranks


RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # x (t-1)/t of the full tensor


def megatron_formula(tp, sequence_parallel, b, s, h, element_size=4):
    """{(pass, op): (count, bytes)} per layer per micro-batch, the full b*s*h tensor per collective."""
    if tp == 1:
        return {}
    full = b * s * h * element_size
    if not sequence_parallel:
        return {("forward", "all_reduce"): (2, 2 * full), ("backward", "all_reduce"): (2, 2 * full)}
    return {("forward", "all_gather"): (2, 2 * full), ("forward", "reduce_scatter"): (2, 2 * full),
            ("backward", "all_gather"): (4, 4 * full), ("backward", "reduce_scatter"): (2, 2 * full)}


def count_layer(tp, sequence_parallel, b, s, h, heads):
    """{(pass, op): (count, bytes)} counted over one TransformerLayer's forward and backward
    (the tensor-parallel groups initialised, TP = tp)."""
    config = GPTConfig(vocab_size=64 * tp, hidden_size=h, num_layers=1, num_attention_heads=heads,
                       max_position_embeddings=s, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    block = TransformerLayer(config, 1)
    x = torch.randn(b, s // (tp if sequence_parallel else 1), h, requires_grad=True)
    with CommCounter.counting() as fwd:
        y = block(x)
    with CommCounter.counting() as bwd:
        y.sum().backward()
    return {(name, op): v for name, counter in (("forward", fwd), ("backward", bwd))
            for op, v in counter.summary().items()}


def _rank(b, s, h, heads):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    tp = torch.distributed.get_world_size()
    initialize_model_parallel(1, tp)
    return {sp: count_layer(tp, sp, b, s, h, heads) for sp in (False, True)}


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    a = p.parse_args(argv)
    b, s, h, out, rows = a.batch, a.seq, a.hidden, harness.Report(a.perf_file, "bench.tensor_parallel_comm", argv), []
    out(f"b={b} s={s} h={h} heads={a.heads}, fp32: b*s*h = {b * s * h * 4} bytes; per layer per micro-batch", "")
    for tp in a.tp:
        counted = run_ranks(tp, _rank, b, s, h, a.heads, timeout=3600, quiet=True)[0]
        for sp in (False, True):
            formula = megatron_formula(tp, sp, b, s, h)
            for key in sorted(set(formula) | set(counted[sp]), key=lambda k: (k[0] != "forward", k[1])):
                (n, nb), (fn, fb) = counted[sp].get(key, (0, 0)), formula.get(key, (0, 0))
                rows.append([tp, "on" if sp else "off", *key, n, fn, nb, fb,
                             round(nb * RING_FACTOR[key[1]] * (tp - 1) / tp), (n, nb) != (fn, fb)])
    out(*harness.table(["TP", "SP", "pass", "collective", "counted", "Megatron", "counted bytes", "Megatron bytes",
                        "ring bytes sent/rank"], "lllllllll", [r[:-1] for r in rows]))
    mismatches = sum(r[-1] for r in rows)
    out(f"\n{'all counts equal the formulas' if not mismatches else f'{mismatches} rows differ from the formulas'}")
    out.save()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
