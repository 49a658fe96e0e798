"""The chunked LM head + cross-entropy (model/chunked_loss.py, --loss-chunk-size) equals the whole head +
gpt_loss in fp32 (1e-6): loss, input and weight gradients, for chunk sizes that do and do not divide the
tokens, a Seq1F1B segment's (labels, num_tokens), and a B/W split (the weight gradient left to W, which
recomputes it), with the arithmetic between the GEMMs eager and compiled ("pipeline.compile_layers"). With
tensor parallelism: tests/model/tensor_parallel (the shared launch); the compiled backward's handling of
targets outside a rank's vocabulary slice: test_compiled_chunk_gradient_skips_targets_outside_the_slice."""
import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.model import GPTConfig, GPTModel
from megatron_ds.model import chunked_loss
from megatron_ds.model.chunked_loss import chunk_math, chunked_linear_cross_entropy
from megatron_ds.model.layers import LMHead, chunked_head_loss, compiled_loss, gpt_loss, loss_function
from megatron_ds.model.linear import WeightGradStore

B, S, H, V = 2, 12, 16, 40


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g) * 0.5,
            torch.randint(0, V, (B, S), generator=g))


def dense(hidden, weight, labels):
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = gpt_loss(F.linear(x, w), labels)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 100])
def test_chunked_equals_whole_logits(chunk):
    hidden, weight, labels = data()
    want = dense(hidden, weight, labels)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(x, w, labels, chunk)
    (loss * 3.0).backward()  # a scaled loss (the engine's gradient-accumulation scaling) scales the gradients
    assert (loss.detach() - want[0]).abs().item() < 1e-6
    assert (x.grad - 3.0 * want[1]).abs().max().item() < 1e-6
    assert (w.grad - 3.0 * want[2]).abs().max().item() < 1e-6


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_segment_loss_and_deferred_weight_gradient(compiled):
    hidden, weight, labels = data(1)
    x, w = hidden[:, 4:].clone().requires_grad_(), weight.clone().requires_grad_()
    xd, wd = x.detach().clone().requires_grad_(), weight.clone().requires_grad_()
    want = gpt_loss(F.linear(xd, wd), (labels[:, 4:], B * S))
    want.backward()
    loss = chunked_linear_cross_entropy(x, w, (labels[:, 4:], B * S), 7, compiled=compiled)
    queue = []
    with WeightGradStore.deferring(queue):
        loss.backward()
    assert len(queue) == 1 and w.grad is None  # B computed the input gradient only
    assert (x.grad - xd.grad).abs().max().item() < 1e-6
    WeightGradStore.drain(queue)
    assert (loss.detach() - want.detach()).abs().item() < 1e-6
    assert (w.grad - wd.grad).abs().max().item() < 1e-6


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_head_hands_hidden_and_weight_to_the_loss(tied):
    """The head layer returns (hidden, weight) and loss_function multiplies them in chunks; GPTModel (the
    single-process model: generation, export) still returns whole logits."""
    kw = dict(vocab_size=V, hidden_size=H, num_layers=1, num_attention_heads=2, max_position_embeddings=S,
              untie_embeddings_and_output_weights=not tied)
    chunked = GPTModel(GPTConfig(**kw, loss_chunk_size=5))
    whole = GPTModel(GPTConfig(**kw))
    tokens = data()[2]
    assert torch.equal(chunked(tokens), whole(tokens))
    config = GPTConfig(**kw, loss_chunk_size=5)
    hidden, weight, labels = data(2)
    out = LMHead(config, 3)(hidden) if not tied else None
    if out is not None:
        assert out[0] is hidden and out[1].shape == (V, H)
        assert (loss_function(config)(out, labels) - gpt_loss(F.linear(hidden, out[1]), labels)).abs() < 1e-6


def test_compiled_chunks_equal_whole_logits():
    """compile_layers' form of the chunked loss (layers.compiled_loss): chunks of 5 and a last one of 4."""
    hidden, weight, labels = data()
    want = dense(hidden, weight, labels)
    loss_fn = compiled_loss(functools.partial(chunked_head_loss, chunk=5, group=None))
    assert loss_fn.keywords["compiled"]
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn((x, w), labels)
    loss.backward()
    assert (loss.detach() - want[0]).abs().item() < 1e-6
    assert (x.grad - want[1]).abs().max().item() < 1e-6 and (w.grad - want[2]).abs().max().item() < 1e-6
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    for fn in (chunked_loss._fused_lse_and_target, chunked_loss._fused_grad_from_logits):  # a graph per chunk shape
        assert len(_debug_get_cache_entry_list(fn.__code__)) >= 2, fn


def test_compiled_chunk_gradient_skips_targets_outside_the_slice():
    """Under tensor parallelism a token whose target lies in another rank's slice has no one-hot here."""
    g = torch.Generator().manual_seed(3)
    logits, lse = torch.randn(6, V, generator=g), torch.randn(6, generator=g)
    local, outside = torch.randint(0, V, (6,), generator=g), torch.tensor([True, False] * 3)
    eager = chunked_loss._grad_from_logits(logits.clone(), local, outside, lse, torch.tensor(0.25))
    compiled = chunk_math(True).fused[1](logits.clone(), local, outside, lse, torch.tensor(0.25))
    assert (compiled - eager).abs().max().item() < 1e-6
    rows = torch.arange(6)
    softmax = torch.exp(logits - lse.unsqueeze(-1)) * 0.25
    assert torch.allclose(compiled[rows, local], softmax[rows, local] - 0.25 * (~outside).float(), atol=1e-6)
