"""Messages of any tensors between a user's own pipeline stages, their shapes learned from the first micro-batch.

Our GPT's messages have one shape, known before the run (PipelinePlan.message_shape). A DeepSpeed
PipelineModule's layers may hand on a tensor or a tuple of tensors of any shapes and dtypes, as DeepSpeed's
engine allows, which it learns from a first metadata message (`_send_tensor_meta`). Here likewise: the first
activation on each edge (replica, stage) -> stage + 1 is preceded by its metadata, and every one under
`dynamic_shape`. A gradient message needs none: it holds the gradients of the floating-point tensors of an
activation its receiver sent, in their order.

A receive is posted ahead of its op (messages.lookahead) only when its shapes are known: posting one whose
metadata has not come would wait for a send that may depend on the op in between. The first iteration's
receives are therefore posted when their op needs them; every later one (static shapes) ahead, as ours, and on
gloo all of them at the iteration's start (P2P.post_all: gloo moves a message only once its receive is posted).
Boolean tensors travel as uint8 (NCCL refuses bool).
"""
import torch
import torch.distributed as dist

from megatron_ds.schedules.kinds import ACT, GRAD

from ..p2p import P2P

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]


def spec_of(payload):
    """(single tensor?, ((shape, dtype), ...)) of a tensor or a tuple of tensors."""
    single = torch.is_tensor(payload)
    tensors = (payload,) if single else tuple(payload)
    if not tensors or not all(torch.is_tensor(t) for t in tensors):
        raise TypeError(f"a pipeline stage must hand on a tensor or a tuple of tensors, got {type(payload)}"
                        + ("" if single or not tensors else f" of {[type(t).__name__ for t in tensors]}"))
    return single, tuple((tuple(t.shape), t.dtype) for t in tensors)


def gradient_spec(spec):
    """The spec of the gradients of an activation of `spec`: its floating-point tensors', in order."""
    single, parts = spec
    return single, tuple((shape, dtype) for shape, dtype in parts if dtype.is_floating_point)


def encode(spec):
    single, parts = spec
    words = [int(single), len(parts)]
    for shape, dtype in parts:
        words += [DTYPES.index(dtype), len(shape), *shape]
    return torch.tensor(words, dtype=torch.int64)


def decode(words):
    words = words.tolist()
    single, count, at, parts = bool(words[0]), words[1], 2, []
    for _ in range(count):
        dtype, ndim = DTYPES[words[at]], words[at + 1]
        parts.append((tuple(words[at + 2:at + 2 + ndim]), dtype))
        at += 2 + ndim
    return single, tuple(parts)


class Shapes:
    """What this rank knows of its edges' activations, kept from iteration to iteration. `dynamic`:
    DeepSpeed's dynamic_shape (metadata with every activation)."""

    def __init__(self, dynamic=False):
        self.dynamic = dynamic
        self.edges = {}  # (replica, stage) -> spec of the activations F(stage) sends (this rank's sends and receives)
        self.sent = {}  # (replica, stage, mb, seq) -> spec, under dynamic shapes: the gradient coming back has it

    def reset(self):
        """Forget them (DeepSpeed's reset_activation_shape: every rank calls it, so both ends agree)."""
        self.edges.clear()
        self.sent.clear()

    def activation(self, key):
        return None if self.dynamic else self.edges.get(key[1:3])

    def gradient(self, key):
        """The spec of GRAD message `key` (B(stage) to stage - 1): what this rank's F(stage - 1) sent (under
        dynamic shapes, in this iteration: None until then, so that a receive posted ahead of that F waits for
        it rather than take the last iteration's shape of the same micro-batch)."""
        _, replica, stage, mb, seq = key
        spec = self.sent.get((replica, stage - 1, mb, seq)) if self.dynamic else self.edges.get((replica, stage - 1))
        return None if spec is None else gradient_spec(spec)

    def received(self, key):
        """GRAD message `key` is posted: under dynamic shapes its activation's spec is spent."""
        if self.dynamic:
            _, replica, stage, mb, seq = key
            del self.sent[(replica, stage - 1, mb, seq)]


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


class LearnedP2P(P2P):
    """P2P whose messages are tensors or tuples of tensors of shapes learned as they go (module docstring)."""

    def __init__(self, plan, rank, group_rank_of, shapes, device):
        super().__init__(plan, rank, group_rank_of, None, None, device)
        self.shapes = shapes

    def send(self, key, dst, payload):
        spec = spec_of(payload)
        edge, peer = key[1:3], self.group_rank_of(dst)
        if key[0] == ACT:
            known = self.shapes.edges.get(edge)
            if self.shapes.dynamic or known is None:
                words = encode(spec).to(self.device)
                self._isend(torch.tensor([words.numel()], dtype=torch.int64, device=self.device), peer)
                self._isend(words, peer)
                self.shapes.edges[edge] = spec
                if self.shapes.dynamic:
                    self.shapes.sent[(key[1], key[2], key[3], key[4])] = spec
            elif known != spec:
                raise RuntimeError(f"stage {key[2]} hands on {spec} where its first micro-batch handed on {known}: "
                                   "build the PipelineModule with dynamic_shape=True, or call the engine's "
                                   "reset_activation_shape() on every rank when the shapes change")
        for tensor in ((payload,) if spec[0] else payload):
            tensor = tensor.detach()
            self._isend(tensor.to(torch.uint8) if tensor.dtype is torch.bool else tensor.contiguous(), peer)

    def _isend(self, tensor, peer):
        self.pending_send.append((dist.isend(tensor, peer), tensor))

    def _irecv(self, key, src, block):
        peer = self.group_rank_of(src)
        spec = self.shapes.activation(key) if key[0] == ACT else self.shapes.gradient(key)
        if spec is None and key[0] == GRAD and block:  # its activation went out before its op can run
            raise RuntimeError(f"rank {self.rank}: gradient {key} is awaited before its activation was sent")
        if spec is None:
            if not block:
                return None
            size = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(size, peer)
            words = torch.empty(int(size), dtype=torch.int64, device=self.device)
            dist.recv(words, peer)
            spec = decode(words)
            self.shapes.edges[key[1:3]] = spec
        if key[0] == GRAD:
            self.shapes.received(key)
        bufs = [torch.empty(shape, dtype=torch.uint8 if dtype is torch.bool else dtype, device=self.device)
                for shape, dtype in spec[1]]
        return _Works([dist.irecv(buf, peer) for buf in bufs]), (spec, bufs)

    def recv(self, key):
        (single, parts), bufs = super().recv(key)
        tensors = tuple(buf.bool() if dtype is torch.bool else buf for buf, (_, dtype) in zip(bufs, parts))
        return tensors[0] if single else tensors
