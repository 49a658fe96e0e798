"""What each rank of a vocabulary-parallel launch computes (tests/model/test_vocab_parallel.py): the
sliced embedding and output layer + cross-entropy, pass by pass as a runtime would run them, against
the whole-vocabulary computation that every rank also does itself, in fp32. Returns per case the
largest differences, with S and T whole and in token chunks (--loss-chunk-size)."""
import torch
import torch.distributed as dist

from megatron_ds.model import vocab_parallel as vp

VOCAB, HIDDEN, BATCH, SEQ = 48, 16, 2, 5
CHUNKS = (0, 3)  # whole, and S and T a chunk of 3 of the 10 tokens at a time (the last chunk 1 token)


def _reference(ids, targets, emb, head, grad_scale):
    """Unsharded: embedding, a stand-in body (tanh of a fixed linear map), logits, mean-token loss."""
    emb = emb.detach().clone().requires_grad_(True)
    head = emb if head is None else head.detach().clone().requires_grad_(True)
    h = torch.nn.functional.embedding(ids, emb)
    h.retain_grad()
    x = torch.tanh(h @ _body())
    x.retain_grad()
    logits = x @ head.t()
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    (losses.reshape(targets.shape) * grad_scale).sum().backward()
    return losses.reshape(targets.shape), x.grad, emb.grad, (None if head is emb else head.grad)


def _body():
    return torch.linspace(-1.0, 1.0, HIDDEN * HIDDEN, dtype=torch.float32).reshape(HIDDEN, HIDDEN)


def _case(tied: bool, rank: int, world: int, seed: int, chunk: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    emb = torch.randn(VOCAB, HIDDEN, generator=g)
    head = None if tied else torch.randn(VOCAB, HIDDEN, generator=g) * 3.0   # large logits: the max matters
    grad_scale = torch.rand(BATCH, SEQ, generator=g) / (BATCH * SEQ)       # e.g. a loss mask over the tokens
    want_loss, want_dx, want_emb, want_head = _reference(ids, targets, emb, head, grad_scale)

    start, end = vp.vocab_range(VOCAB, rank, world)
    emb_slice = emb[start:end]
    head_slice = emb_slice if tied else head[start:end]
    # EF, reduced to every rank; the body on the whole embedding (its own ranks' business)
    h = vp.reduce_embedding(vp.embedding_forward(ids, emb_slice, start))
    h = h.detach().requires_grad_(True)
    x = torch.tanh(h @ _body())
    # S on every rank, the barrier, T on every rank
    s = vp.output_s_pass(x.detach(), head_slice, targets, start, chunk=chunk)
    assert (s.softmax is None) == bool(chunk)  # chunked: T recomputes the slice's softmax
    stats = vp.reduce_statistics(s, grad_scale)
    head_grad = vp.output_t_pass(s, stats, x.detach(), grad_scale, weight=head_slice, chunk=chunk)
    # the body's backward from the barrier's input gradient, then EW from stage 0's input gradient
    x.backward(stats.input_grad)
    emb_grad = vp.embedding_weight_grad(ids, h.grad, end - start, start)
    if tied:
        emb_grad = emb_grad + head_grad
    diff = {
        "loss": (stats.loss - want_loss).abs().max().item(),
        "input_grad": (stats.input_grad - want_dx).abs().max().item(),
        "embedding_grad": (emb_grad - want_emb[start:end]).abs().max().item(),
    }
    if not tied:
        diff["head_grad"] = (head_grad - want_head[start:end]).abs().max().item()
    scale = {"loss": want_loss.abs().max().item(), "input_grad": want_dx.abs().max().item(),
             "embedding_grad": want_emb.abs().max().item()}
    if not tied:
        scale["head_grad"] = want_head.abs().max().item()
    return diff, scale


def run_all(world):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank = dist.get_rank()
    out = {}
    for tied in (False, True):
        for seed in (1, 2):
            for chunk in CHUNKS:
                out[(tied, seed, chunk)] = _case(tied, rank, world, seed, chunk)
    dist.destroy_process_group()
    return out
