"""model/compile.compile_loss: the cross-entropy compiled as its own region gives eager's loss and
gradient, and keeps for its backward the bf16 logits as they came instead of eager's fp32
log-probabilities (half the bytes: on the LLaMA-style reference model, 8192 tokens x 50304 a micro-batch, 0.8 GB
less per micro-batch in flight).
Equality of the compiled loss inside the engines, fp32, whole and per Seq1F1B segment:
tests/pipe/test_compile_engine.py."""
import pytest
import torch

from megatron_ds.model.compile import compile_loss
from megatron_ds.model.layers import gpt_loss

TOKENS, VOCAB = 96, 1000


def loss_grad_and_saved_bytes(loss_fn, logits, labels):
    """(loss, the logits' gradient, bytes autograd keeps for backward: each storage once)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = logits.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad, sum(saved.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_compiled_loss_equals_eager_and_keeps_the_logits_not_fp32_log_probs(device):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, TOKENS // 2, VOCAB, generator=g)).bfloat16().to(device)
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g).to(device)
    eager = loss_grad_and_saved_bytes(gpt_loss, logits, labels)
    compiled = loss_grad_and_saved_bytes(compile_loss(gpt_loss), logits, labels)
    assert eager[0].dtype == compiled[0].dtype == torch.float32
    assert abs(compiled[0].item() - eager[0].item()) <= 1e-6 * eager[0].item(), (compiled[0], eager[0])
    assert compiled[1].dtype == torch.bfloat16
    # both compute the gradient in fp32 and round it once to bf16: at most one bf16 step apart
    assert torch.allclose(compiled[1].float(), eager[1].float(), rtol=2 ** -7, atol=1e-9)
    logits_bytes = logits.numel() * logits.element_size()
    assert eager[2] >= 2 * logits_bytes  # fp32 log-probabilities
    assert compiled[2] <= logits_bytes + 64 * TOKENS, (compiled[2], logits_bytes)  # + a few per-token values


def test_the_compile_line_says_what_the_first_iteration_cost(monkeypatch):
    """A run's first iteration took 14.1 s against 0.34 s eager, of which the compile metrics held 5.1 s:
    the line gives the iteration's wall time, the ones after it and the compile share, not 5.1 s alone."""
    from megatron_ds.model import compile as regions
    monkeypatch.setattr(regions, "compile_seconds", lambda: 5.1)
    monkeypatch.setattr(regions, "unplanned_graph_breaks", lambda: {})
    head = "> compiled regions (torch.compile, per layer and the loss): "
    assert regions.compile_summary(14.1, 0.34) == (head + "the first iteration took 14.1 s against 0.34 s for the "
                                                   "ones after it, 5.1 s (36%) of it compiling in this process")
    assert regions.compile_summary(14.1) == head + "the first iteration took 14.1 s, 5.1 s (36%) of it compiling " \
                                                   "in this process"
    assert regions.compile_summary() == head + "5.1 s compiling in this process"
    monkeypatch.setattr(regions, "compile_seconds", lambda: 0.0)
    assert regions.compile_summary(14.1, 0.34) is None  # nothing compiled: an eager run says nothing
