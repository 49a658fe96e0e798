"""The chunked LM head + cross-entropy (model/chunked_loss.py, --loss-chunk-size) equals the whole head +
gpt_loss in fp32 (1e-6): loss, input and weight gradients, for chunk sizes that do and do not divide the
tokens, a Seq1F1B segment's (labels, num_tokens), and a B/W split (the weight gradient left to W, which
recomputes it). With tensor parallelism: tests/model/tensor_parallel (the shared launch)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.model import GPTConfig, GPTModel
from megatron_ds.model.chunked_loss import chunked_linear_cross_entropy
from megatron_ds.model.layers import LMHead, gpt_loss, loss_function
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


def test_segment_loss_and_deferred_weight_gradient():
    hidden, weight, labels = data(1)
    x, w = hidden[:, 4:].clone().requires_grad_(), weight.clone().requires_grad_()
    xd, wd = x.detach().clone().requires_grad_(), weight.clone().requires_grad_()
    want = gpt_loss(F.linear(xd, wd), (labels[:, 4:], B * S))
    want.backward()
    loss = chunked_linear_cross_entropy(x, w, (labels[:, 4:], B * S), 7)
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
