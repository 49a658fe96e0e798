"""Which tokens of a sequence a context-parallel rank holds: Megatron-core's load-balanced layout.

A sequence (or a Seq1F1B segment) of length s is cut into 2 x CP chunks of s / (2 x CP) tokens; rank r holds
chunks r and 2CP-1-r, in that order. Under causal attention a chunk's cost grows with its index, so each rank
pairs a cheap chunk with an expensive one and every rank attends the same number of (query, key) pairs.

Everything a CP rank computes per token (embedding, MLP, norms, loss) runs on its s / CP tokens as if they were
a shorter sequence; attention alone needs each local token's global position, which `positions` gives.
"""
from dataclasses import dataclass

import torch

from megatron_ds.parallel_layout import layout_problem  # the rule's one home (torch-free: the flags' checks use it)


@dataclass(frozen=True)
class ContextLayout:
    size: int  # CP ranks
    rank: int  # this rank's index in the CP group

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} is not in a group of {self.size}")

    @classmethod
    def of(cls, group):
        """The layout of this process in `group` (None: one rank holding everything)."""
        if group is None:
            return cls(1, 0)
        import torch.distributed as dist  # lazy: the layout's arithmetic needs no process group
        return cls(dist.get_world_size(group), dist.get_rank(group))

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunk indices rank `rank` (this one by default) holds, in its order."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r

    def local_length(self, length: int) -> int:
        problem = layout_problem(length, self.size, "the sequence length")
        if problem:
            raise ValueError(problem)
        return length // self.size

    def positions(self, length: int, start: int = 0, rank: int | None = None, device=None) -> torch.Tensor:
        """Global positions (length / CP,) of the tokens rank `rank` holds of a sequence (or segment) of `length`
        tokens whose first one is at position `start`, in local order."""
        half = self.local_length(length) // 2
        first, second = self.chunks(rank)
        local = torch.arange(half, device=device)
        return torch.cat((first * half + local, second * half + local)) + start

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of t (their global order along `dim`), in local order: its two chunks concatenated."""
        if self.size == 1:
            return t
        half = self.local_length(t.shape[dim]) // 2
        first, second = self.chunks()
        return torch.cat((t.narrow(dim, first * half, half), t.narrow(dim, second * half, half)), dim=dim)

    def unshard(self, parts, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's local part (parts[r] is rank r's, as `shard` cut it)."""
        if self.size == 1:
            return parts[0]
        half = parts[0].shape[dim] // 2
        chunks = [None] * (2 * self.size)
        for r, part in enumerate(parts):
            first, second = self.chunks(r)
            chunks[first], chunks[second] = part.narrow(dim, 0, half), part.narrow(dim, half, half)
        return torch.cat(chunks, dim=dim)
