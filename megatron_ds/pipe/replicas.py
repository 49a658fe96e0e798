"""Two model replicas on one pipeline (BitPipe): keep the twin chunks identical.

Replica 1's stage s is the same layers as replica 0's stage s, held by the mirror
rank. Twins start from identical weights (broadcast from replica 0's copy) and
stay identical: after backward each chunk's gradients are summed with its twin's
(every loss is already divided by the whole step's micro-batch count, so the sum
is the full-batch gradient). One process group per stage keeps the two ranks'
collectives matched whatever order their chunks finish in, so a chunk's
all-reduce is launched asynchronously the moment its last backward op is done
("eager" sync, overlapping the remaining backward work) and waited for only
before the data-parallel reduction. A step of m <= p/2 micro-batches sends them all
down: the up replica's chunks run nothing, and their zero gradients meet their twins'
all-reduce from the start of the step (idle_chunks).
"""
import functools
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_ds.schedules.kinds import Kind


def chunk_parameters(module):
    """{chunk: [params]} with each parameter listed once, under its lowest stage (a tied
    embedding shared by the first and last chunk belongs to the first)."""
    seen, out = set(), {}
    for chunk in sorted(module.chunks, key=lambda c: (c[1], c[0])):
        params = []
        for f in module.chunk_funcs[chunk]:
            owner = f.args[0] if isinstance(f, functools.partial) else f
            if isinstance(owner, torch.nn.Module):
                for p in owner.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        out[chunk] = params
    return out


def idle_chunks(schedule, chunks):
    """Those of `chunks` (one rank's) that run no backward op in `schedule` while their twin does: a
    replica that got no micro-batch (every rank reads the same schedule, so both twins agree)."""
    busy = {(op.replica, op.stage) for ops in schedule.ranks for op in ops
            if op.kind is not Kind.F and not op.kind.traits.vocab}
    return [c for c in chunks if c not in busy and (1 - c[0], c[1]) in busy]


class ReplicaSync:
    """Gradient and weight sync between twin chunks on mirror ranks (one DP replica's pipeline)."""

    def __init__(self, module, grid):
        self.module = module
        placement = module.placement
        self.params = chunk_parameters(module)
        self.groups = {}  # stage -> process group of its two holders (this DP index and TP rank)
        others = [dict(data=dp) for dp in range(grid.data_parallel_size)]
        if "model" in grid.topology().get_axis_names():  # tensor parallelism: twins per TP rank
            others = [dict(other, model=mp) for other in others for mp in range(grid.model_parallel_size)]
        for stage in range(len(placement[0])):
            for other in others:
                ranks = sorted(grid.stage_to_global(stage_id=placement[rep][stage], **other) for rep in (0, 1))
                group = dist.new_group(ranks=ranks)  # every rank takes part in every new_group
                if dist.get_rank() in ranks:
                    self.groups[stage] = (group, grid.stage_to_global(stage_id=placement[0][stage], **other))
        for (rep, _), params in self.params.items():
            if rep == 1:  # count each replicated parameter once in grad norms and overflow checks
                for p in params:
                    p.ds_pipe_replicated = True
        self.pending = []
        self.launched = []  # (chunk, perf_counter time) of this step's gradient all-reduces
        self.last_backward_end = None  # perf_counter time the rank's latest backward op ended

    def broadcast_weights(self):
        """Copy replica 0's weights onto its twins (at start and after loading a checkpoint)."""
        for chunk in sorted(self.params, key=lambda c: c[1]):
            group, src = self.groups[chunk[1]]
            with torch.no_grad():
                for p in self.params[chunk]:
                    dist.broadcast(p.data, src=src, group=group)

    def start_step(self, idle):
        """A training step starts; `idle` (idle_chunks) get zero gradients, synced with their twins now."""
        self.launched.clear()
        for chunk in idle:
            for p in self.params[chunk]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.launch(chunk)

    def after_backward(self, chunk=None):
        """Called as each backward op ends; `chunk` when that op completed the chunk's gradients."""
        self.last_backward_end = time.perf_counter()
        if chunk is not None:
            self.launch(chunk)

    def launch(self, chunk):
        if not self.params[chunk]:  # parameter-free layers (a user's own PipelineModule may cut such a chunk)
            return
        grads = [p.grad for p in self.params[chunk] if p.grad is not None]
        if len(grads) != len(self.params[chunk]):
            raise RuntimeError(f"chunk {chunk} finished backward with parameters lacking gradients")
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.groups[chunk[1]][0], async_op=True)
        self.pending.append((work, flat, grads))
        self.launched.append((chunk, time.perf_counter()))

    def wait(self):
        for work, flat, grads in self.pending:
            work.wait()
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self.pending.clear()
