"""The ring's backward overlaps its gradient transfers (context_parallel/ring.py), on one process with the ring's
sends and receives replaced by a recorder: each step's gradient block is waited for only after the next step's
blocks are attended (C - 1 of the C hidden, the last after the last compute), the K/V of the next step are
posted before the step's blocks as forward does, and no buffer changes while it is in flight. The values are the
multi-rank tests' (test_attention.py, against fp64 full attention); here only the order is checked."""
import argparse

import pytest
import torch

from megatron_ds.model.context_parallel import ring
from megatron_ds.model.context_parallel.layout import ContextLayout


class Recorder:
    def __init__(self):
        self.events, self.posted = [], []

    def exchange(self, t, plan, tag):
        kind = "kv" if tag == ring._KV_TAG else "grad"
        works = [(kind, len(self.posted))]
        self.posted.append((t, t.clone()))
        self.events.append(("post", kind, works[0][1]))
        return torch.zeros_like(t), works

    def wait(self, works):
        for kind, index in works:
            sent, copy = self.posted[index]
            assert torch.equal(sent, copy), f"{kind} buffer {index} changed while in flight"
            self.events.append(("wait", kind, index))


def test_each_gradient_block_travels_while_the_next_block_is_attended(monkeypatch):
    size, rank, length = 4, 1, 16
    layout = ContextLayout(size, rank)
    keys = tuple(tuple(ring.chunk_spans(layout, length, 0, r)) for r in range(size))
    plan = ring.RingPlan(None, layout, keys[rank], keys, 0.5)
    recorder = Recorder()
    monkeypatch.setattr(ring, "_exchange", recorder.exchange)
    monkeypatch.setattr(ring, "_wait", recorder.wait)
    block_backward = ring.block_backward

    def attended(*args):
        recorder.events.append(("block",))
        return block_backward(*args)

    monkeypatch.setattr(ring, "block_backward", attended)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, length // size, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    out = ring._Ring.apply(q, k, v, plan)
    recorder.events.clear()
    out.sum().backward()
    events = recorder.events

    grads = [e for e in events if e[:2] == ("post", "grad")]
    assert len(grads) == size and sum(e[:2] == ("post", "kv") for e in events) == size - 1  # docs' per-layer counts
    for n, (_, _, index) in enumerate(grads):
        posted, waited = events.index(("post", "grad", index)), events.index(("wait", "grad", index))
        between = events[posted:waited]
        if n < size - 1:  # the next step attends its blocks meanwhile
            assert ("block",) in between, (n, between)
            assert events[waited + 1][:2] == ("post", "grad")  # then the sum that arrived goes straight on
        else:  # the last: home to its owner after the last compute, nothing left to hide it
            assert ("block",) not in between and waited == len(events) - 1
    kv_posts = [i for i, e in enumerate(events) if e[:2] == ("post", "kv")]
    assert all(events[i + 1] == ("block",) for i in kv_posts)  # each step's next K/V in flight before its blocks
    assert k.grad.shape == k.shape and torch.isfinite(q.grad).all()


class _Work:
    """As gloo's: holds the tensors it sent and received until dropped, waited for or not."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        pass


class _Links:
    """torch.distributed as ring._exchange calls it, on one process: each batch of sends and receives one work."""
    isend, irecv = "isend", "irecv"

    @staticmethod
    def P2POp(op, tensor, peer, group, tag):  # noqa: N802 - torch's name
        return tensor

    @staticmethod
    def get_global_rank(group, rank):
        return rank

    @staticmethod
    def batch_isend_irecv(ops):
        return [_Work(list(ops))]


@pytest.mark.parametrize("size", [2, 4])
def test_the_ring_holds_what_its_docstring_says_and_no_block_more(monkeypatch, size):
    """Blocks counted from allocation until nothing (a variable, a finished work) holds them: forward two K/V blocks;
    backward two K/V blocks and three gradient blocks (C = 2: one K/V block then), what the cost model's in-flight
    bytes count (schedules/context_parallel.layer_bytes). Held by their finished works and the previous arrival,
    the blocks were one K/V block and one gradient block more (C = 4: 3 and 4)."""
    from megatron_ds.schedules.context_parallel import layer_bytes
    from megatron_ds.testing.saved_memory import RingBuffers
    rank, length, batch, kv_heads, dim = 1, 8 * size, 2, 2, 8
    layout = ContextLayout(size, rank)
    keys = tuple(tuple(ring.chunk_spans(layout, length, 0, r)) for r in range(size))
    plan = ring.RingPlan(None, layout, keys[rank], keys, 0.5)
    monkeypatch.setattr(ring, "dist", _Links)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, length // size, dim, generator=g, requires_grad=True) for h in (4, kv_heads, kv_heads))
    block = 2 * k.numel() * 4  # keys and values, fp32 (their gradients too)
    forward, backward = RingBuffers(), RingBuffers()
    with forward.installed(ring):
        out = ring._Ring.apply(q, k, v, plan)
    with backward.installed(ring):
        out.sum().backward()
    assert forward.now == backward.now == 0  # no block outlives its pass
    assert forward.peak == 2 * block
    assert backward.peak == (2 if size > 2 else 1) * block + 3 * block
    shape = argparse.Namespace(hidden_size=4 * dim, num_attention_heads=4, num_key_value_heads=kv_heads,
                               ffn_hidden_size=64, num_layers=1, vocab_size=64, swiglu=False)
    model = layer_bytes(shape, length, size, "p2p", batch, dtype_bytes=4).in_flight
    assert model == (forward.peak, backward.peak)
