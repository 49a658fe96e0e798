"""Tensor-parallel communication per transformer layer per micro-batch: counted vs Megatron's formulas.

Runs one GPT-2 block built from megatron_ds.model.tensor_parallel's layers on TP gloo
ranks, counts every collective the layers issue (CommCounter) in the forward and the
backward, and prints them beside the formulas of Megatron's papers (bytes of the full
b x s x h activation per collective, fp32 here):

  without sequence parallelism: forward 2 all-reduces (after the attention and MLP
    row-parallel linears), backward 2 all-reduces (before the two column-parallel ones);
  with sequence parallelism: forward 2 all-gathers + 2 reduce-scatters, backward
    2 all-gathers + 2 reduce-scatters, plus 2 all-gathers that re-gather the column-parallel
    inputs for their weight gradients (Megatron saves only the sequence shard).

An all-reduce moves about twice an all-gather's bytes per rank (ring: 2(t-1)/t vs (t-1)/t
of the tensor), so both variants move the same volume. Prints a table; never a timed test.

  python bench/tensor_parallel_comm.py [--tp 2 4] [--batch 2 --seq 16 --hidden 64 --heads 8]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from launch import launch  # noqa: E402
from megatron_ds.model.tensor_parallel import (ColumnParallelLinear, CommCounter, ParallelState,  # noqa: E402
                                               RowParallelLinear)
from megatron_ds.model.tensor_parallel.comm import world_size  # noqa: E402


class ParallelBlock(nn.Module):
    """A pre-LayerNorm GPT-2 block on the tensor-parallel layers (attention heads and MLP columns split)."""

    def __init__(self, hidden, heads, group, sequence_parallel):
        super().__init__()
        tp = world_size(group)
        init = lambda w: w.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))  # noqa: E731
        kwargs = dict(init_method=init, group=group, sequence_parallel=sequence_parallel)
        self.local_heads, self.head_dim = heads // tp, hidden // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, sections=[hidden] * 3, **kwargs)
        self.proj = RowParallelLinear(hidden, hidden, **kwargs)
        self.fc = ColumnParallelLinear(hidden, 4 * hidden, **kwargs)
        self.fc_proj = RowParallelLinear(4 * hidden, hidden, **kwargs)

    def attention(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


def megatron_formula(tp, sequence_parallel, b, s, h, element_size=4):
    """{(pass, op): (count, bytes)} per layer per micro-batch, the full b*s*h tensor per collective."""
    if tp == 1:
        return {}
    full = b * s * h * element_size
    if not sequence_parallel:
        return {("forward", "all_reduce"): (2, 2 * full), ("backward", "all_reduce"): (2, 2 * full)}
    return {("forward", "all_gather"): (2, 2 * full), ("forward", "reduce_scatter"): (2, 2 * full),
            ("backward", "all_gather"): (4, 4 * full), ("backward", "reduce_scatter"): (2, 2 * full)}


def count_layer(group, sequence_parallel, b, s, h, heads):
    """{(pass, op): (count, bytes)} counted over one block's forward and backward."""
    block = ParallelBlock(h, heads, group, sequence_parallel)
    x = torch.randn(b, s // (world_size(group) if sequence_parallel else 1), h, requires_grad=True)
    with CommCounter.counting() as fwd:
        y = block(x)
    with CommCounter.counting() as bwd:
        y.sum().backward()
    return {(name, op): v for name, counter in (("forward", fwd), ("backward", bwd))
            for op, v in counter.summary().items()}


def _rank(b, s, h, heads):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    state = ParallelState(1, torch.distributed.get_world_size())
    return {sp: count_layer(state.tensor_parallel_group_or_none(), sp, b, s, h, heads) for sp in (False, True)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    a = p.parse_args()
    b, s, h = a.batch, a.seq, a.hidden
    print(f"b={b} s={s} h={h} heads={a.heads}, fp32: b*s*h = {b * s * h * 4} bytes; per layer per micro-batch\n")
    print("| TP | SP | pass | collective | counted | Megatron | counted bytes | Megatron bytes |")
    print("|---|---|---|---|---|---|---|---|")
    mismatches = 0
    for tp in a.tp:
        counted = launch(tp, _rank, b, s, h, a.heads)
        for sp in (False, True):
            formula = megatron_formula(tp, sp, b, s, h)
            for key in sorted(set(formula) | set(counted[sp]), key=lambda k: (k[0] != "forward", k[1])):
                (n, nb), (fn, fb) = counted[sp].get(key, (0, 0)), formula.get(key, (0, 0))
                mismatches += (n, nb) != (fn, fb)
                print(f"| {tp} | {'on' if sp else 'off'} | {key[0]} | {key[1]} | {n} | {fn} | {nb} | {fb} |")
    print(f"\n{'all counts equal the formulas' if not mismatches else f'{mismatches} rows differ from the formulas'}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
