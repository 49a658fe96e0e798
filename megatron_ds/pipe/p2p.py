"""The torch side of a MessagePlan (messages.py): one rank's isends and irecvs of an iteration.

Sends are non-blocking (isend), so a rank only ever waits on a receive; the validated op
order then guarantees progress. Receives are posted in the sender's order (see messages.py).
"""
from collections import defaultdict

import torch
import torch.distributed as dist


class P2P:
    """One rank's side of a MessagePlan for one iteration."""

    def __init__(self, plan, rank, group_rank_of, shape_of, dtype_of, device):
        self.plan, self.rank = plan, rank
        self.group_rank_of = group_rank_of  # pipeline rank -> global rank
        self.shape_of, self.dtype_of, self.device = shape_of, dtype_of, device  # message key -> its shape, dtype
        self.posted_upto = defaultdict(int)  # src -> how many of its messages to us are posted
        self.pending_recv = {}  # key -> (work, tensor)
        self.pending_send = []

    def send(self, key, dst, tensor):
        tensor = tensor.detach().contiguous()
        self.pending_send.append((dist.isend(tensor, self.group_rank_of(dst)), tensor))

    def post(self, key, block=True):
        """Post the irecv of `key` (and, first, those of the messages its sender sends before it). `block`
        false: a receive ahead of its op, which stops short of a message whose shape is not known yet."""
        src = self.plan.source[key]
        expected = self.plan.sends[(src, self.rank)]
        while key not in self.pending_recv:
            nxt = expected[self.posted_upto[src]]
            posted = self._irecv(nxt, src, block)
            if posted is None:
                return
            self.pending_recv[nxt] = posted
            self.posted_upto[src] += 1

    def post_all(self):
        """Post the irecv of every message of the iteration whose shape is known, each sender's in its order, so
        that each moves as soon as its sender sends it. Only for a backend on which a posted receive holds up no
        send (gloo): NCCL runs a pair's sends and receives in order on one stream, where a receive posted far
        ahead would stall the sends behind it."""
        for (src, dst), keys in self.plan.sends.items():
            if dst == self.rank and keys:
                self.post(keys[-1], block=False)

    def _irecv(self, key, src, block):
        """(work, buffer) of the posted receive of `key`; None where it must wait to learn its shape and
        may not (the plan's shapes are known: it never must)."""
        buf = torch.empty(self.shape_of(key), dtype=self.dtype_of(key), device=self.device)
        return dist.irecv(buf, self.group_rank_of(src)), buf

    def recv(self, key):
        self.post(key)
        work, buf = self.pending_recv.pop(key)
        work.wait()
        return buf

    def finish(self):
        """Wait for every send; every posted receive must have been consumed."""
        for work, _ in self.pending_send:
            work.wait()
        self.pending_send.clear()
        if self.pending_recv:
            raise RuntimeError(f"rank {self.rank}: messages received but never used: {sorted(self.pending_recv)}")
