"""The model on a CUDA GPU (skipped without one): FlashAttention through SDPA in bf16, the Seq1F1B
segment K/V cache on the kernels' own bottom-right causal alignment (no mask materialised, queries in
position order). Deferred weight gradients on CUDA: tests/model/test_gpt.py's device parameter."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_ds.model import GPTConfig, GPTModel, gpt_loss
from megatron_ds.model.kv_cache import SegmentKVCache, queries_reversed
from tests.model.test_segment_attention import FAMILIES as SEGMENT_FAMILIES
from tests.model.test_segment_attention import full_run, segmented_run, two_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = {"gpt2": {}, "llama": dict(SEGMENT_FAMILIES["llama"], untie_embeddings_and_output_weights=True)}


def model_config(**kw):
    # head_dim 64: a size the flash kernels take
    return GPTConfig(vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
                     max_position_embeddings=512, seed=5, **kw)


def tokens_and_labels(cfg, b=2, s=512):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g).cuda()
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    loss = gpt_loss(model(tokens), labels)
    loss.backward()
    return loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_flash_attention_in_bf16_follows_the_fp32_model(family):
    """Only the flash kernels allowed: the bf16 model's loss and gradients stay within bf16's
    rounding of the fp32 model (math kernels) on the same weights."""
    cfg = model_config(**FAMILIES[family])
    reference = GPTModel(cfg).cuda()
    model = GPTModel(cfg).cuda().to(torch.bfloat16)
    tokens, labels = tokens_and_labels(cfg)
    with sdpa_kernel(SDPBackend.MATH):
        ref_loss, ref_grads = loss_and_grads(reference, tokens, labels)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loss, grads = loss_and_grads(model, tokens, labels)
    assert abs(loss - ref_loss) / ref_loss < 1e-2, (loss, ref_loss)
    worst = max((relative_error(grads[n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] < 5e-2, f"gradient of {worst[1]}: relative error {worst[0]:.3g}"


def segment_run_on_cuda(dtype, lengths, backend, family="llama", defer=True):
    """segmented vs full through tests/model/test_segment_attention.py's runs, on CUDA in `dtype`."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 32, generator=g).cuda().to(dtype)
    grad_out = torch.randn(2, 64, 32, generator=g).cuda().to(dtype)

    def layers():
        return two_layers(**SEGMENT_FAMILIES.get(family, {})).cuda().to(dtype)
    with sdpa_kernel(backend):
        return full_run(layers(), x, grad_out), segmented_run(layers(), x, grad_out, lengths, defer=defer)


def max_abs(a, b):
    return (a.float() - b.float()).abs().max().item()


FP32_KERNELS = {"gpt2": [SDPBackend.EFFICIENT_ATTENTION],  # takes the bottom-right alignment natively
                "llama": [SDPBackend.MATH]}  # grouped K/V in fp32: no fused kernel here, math on a materialised mask


@pytest.mark.parametrize("family", FP32_KERNELS)
@pytest.mark.parametrize("lengths", [[32, 32], [24, 8, 32], [16, 16, 8, 24]])
def test_segments_equal_full_attention_fp32(family, lengths):
    (y, gx, gw), (ys, gxs, gws) = segment_run_on_cuda(torch.float32, lengths, FP32_KERNELS[family], family)
    assert max_abs(ys, y) <= 1e-5 and max_abs(gxs, gx) <= 1e-5
    for name in gw:
        assert max_abs(gws[name], gw[name]) <= 1e-5, name


@pytest.mark.parametrize("lengths", [[32, 32], [24, 8, 32]])
def test_segments_on_flash_in_bf16(lengths):
    """bf16 with only the flash kernels allowed: the segments run (the bottom-right alignment needs no
    mask) and differ from the full sequence by no more than bf16 differs from fp32 there."""
    (y, gx, gw), (ys, gxs, gws) = segment_run_on_cuda(torch.bfloat16, lengths, SDPBackend.FLASH_ATTENTION)
    (y32, gx32, _), _ = segment_run_on_cuda(torch.float32, lengths, SDPBackend.MATH)
    bf16_error = max_abs(y, y32)
    assert max_abs(ys, y) <= 4 * bf16_error + 1e-2, (max_abs(ys, y), bf16_error)
    assert max_abs(gxs, gx) <= 4 * max_abs(gx, gx32) + 1e-2


def test_nothing_materialised_on_cuda():
    """On CUDA queries stay in position order and no mask tensor is cached."""
    assert not queries_reversed("cuda")
    layers = two_layers(**SEGMENT_FAMILIES["llama"]).cuda().to(torch.bfloat16)
    cache, x = SegmentKVCache(), torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for start in (0, 32):
            with cache.segment(("mb", 0), start, start + 32, 64):
                layers(x[:, start:start + 32])
    assert cache.mask_tensors() == []
    assert {t.device.type for t in cache.kv_tensors()} == {"cuda"}


@pytest.mark.parametrize("segment", [False, True], ids=["mean", "segment-sum"])
def test_liger_fused_head_loss_equals_gpt_loss(segment):
    """--use-liger-kernel: Liger's fused linear cross-entropy equals the head's logits + gpt_loss in fp32
    (loss, input and weight gradients), as the whole mean and as a Seq1F1B segment's sum / token count."""
    pytest.importorskip("liger_kernel")
    from megatron_ds.model.layers import liger_head_loss
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 256, 128, generator=g).cuda().requires_grad_()
    weight = (0.05 * torch.randn(1000, 128, generator=g)).cuda().requires_grad_()
    labels = torch.randint(0, 1000, (2, 256), generator=g).cuda()
    target = (labels, 4 * labels.numel()) if segment else labels
    results = []
    for fused in (False, True):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = liger_head_loss((h, w), target) if fused else gpt_loss(h @ w.t(), target)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for (a, b), name in zip(zip(*results), ("loss", "hidden grad", "weight grad")):
        assert (a - b).abs().max().item() < 1e-5 * max(1.0, b.abs().max().item()), name
