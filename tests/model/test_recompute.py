"""Selective recompute (model/recompute.py) on one transformer layer: its output, input gradient and every
parameter's gradient equal the layer's without recompute bit for bit (dropout included: the recomputation
replays the forward's masks), eager and compiled (compile_layers); what it keeps for backward is what it kept
less the attention core's own tensors plus the core's inputs, to the byte as schedules/recompute.layer_memory
counts them (which the simulator's memory model takes), and the whole layer's activations within 2 % of that
count (RoPE's tables, shared by every layer, are not in it). Gradient equality inside the engines, every
recompute mode and schedule: tests/pipe/test_recompute_engine.py."""
import contextlib

import pytest
import torch

from megatron_ds.model import GPTConfig
from megatron_ds.model.compile import compile_layers
from megatron_ds.model.layers import TransformerLayer
from megatron_ds.model.linear import WeightGradStore
from megatron_ds.schedules.recompute import Recompute, layer_memory
from megatron_ds.testing.saved_memory import SavedMemory

SEQ, MBS, HIDDEN = 128, 2, 64
LLAMA = dict(position_embedding_type="rope", swiglu=True, normalization="rmsnorm", add_bias_linear=False,
             num_key_value_heads=2)
MODELS = {
    "gpt2": {}, "gpt2-dropout": dict(attention_dropout=0.1, hidden_dropout=0.1),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "llama": LLAMA, "llama-dropout": dict(LLAMA, attention_dropout=0.1),
    "qwen3-dropout": dict(LLAMA, qk_layernorm=True, attention_dropout=0.1, hidden_dropout=0.1),
    "wide-heads": dict(LLAMA, qk_layernorm=True, kv_channels=32, attention_dropout=0.1),  # heads x 32 > hidden
}


def config(granularity=None, **model):
    return GPTConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=4,
                     max_position_embeddings=SEQ, recompute_granularity=granularity, **model)


def run_layer(cfg, compiled=False):
    """(output, input gradient, parameter gradients, bytes kept for backward after the forward)."""
    layer = TransformerLayer(cfg, 1)
    if compiled:
        compile_layers([layer], defer_weight_grads=False)
    x = torch.randn(MBS, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5), requires_grad=True)
    meter = SavedMemory(exclude=layer.parameters())
    torch.manual_seed(7)  # the dropout masks
    with meter.recording():
        y = layer(x)
        kept = meter.now
        (y * torch.linspace(-1, 1, HIDDEN)).sum().backward()
    return y.detach(), x.grad, [p.grad for p in layer.parameters()], kept


@pytest.mark.parametrize("model", MODELS)
def test_selective_equals_none_bit_for_bit_and_keeps_what_the_model_counts(model):
    none, selective = run_layer(config(**MODELS[model])), run_layer(config("selective", **MODELS[model]))
    assert torch.equal(none[0], selective[0]) and torch.equal(none[1], selective[1])
    assert all(torch.equal(a, b) for a, b in zip(none[2], selective[2]))
    counted = layer_memory(config(**MODELS[model]), SEQ, MBS, 4)
    assert none[3] - selective[3] == counted.selective_saving
    assert abs(none[3] - counted.kept) <= 0.02 * none[3], (none[3], counted.kept)


@pytest.mark.parametrize("model, split", [("gpt2-dropout", False), ("gpt2-dropout", True), ("llama-dropout", False),
                                          ("llama-dropout", True), ("gpt2", False)])
def test_a_recomputing_backward_rises_as_counted(model, split):
    """Backward reaches the core after freeing the part after it (a split B keeps W's share of that part): the
    recomputed core's tensors then rise above the level backward started from by what layer_memory's stage()
    says (the simulator's transient). Fused, a split B's queue for W outgrows what it frees with or without
    recompute, which the count leaves out: only the BW is compared there."""
    cfg = config("selective", **MODELS[model])
    layer = TransformerLayer(cfg, 1)
    x = torch.randn(MBS, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5), requires_grad=True)
    meter, queue = SavedMemory(exclude=layer.parameters()), []
    with meter.recording():
        y = layer(x)
        kept = meter.now
        meter.reset_peak()
        with WeightGradStore.deferring(queue) if split else contextlib.nullcontext():
            torch.autograd.backward(y, torch.ones_like(y))
        rise = meter.peak - kept
    counted = layer_memory(cfg, SEQ, MBS, 4).stage(Recompute("selective"), 1)
    assert rise == counted[2 if split else 3]


def test_selective_saves_the_s_by_s_part_where_the_core_keeps_it():
    """Unfused (attention dropout on CPU) the core keeps (s x s) per head, three times: selective frees more than
    half of the layer's activations here; fused (flash) it keeps its output, which the output projection keeps
    anyway, and the softmax statistics: selective saves those alone."""
    unfused, fused = (layer_memory(config(**MODELS[m]), SEQ, MBS, 4) for m in ("gpt2-dropout", "gpt2"))
    scores = MBS * 4 * SEQ * SEQ * 4
    assert unfused.selective_saving == 3 * scores and unfused.selective_saving > 0.5 * unfused.kept
    assert fused.selective_saving == MBS * 4 * SEQ * 4  # a float per query and head
    on_cuda = layer_memory(config(**MODELS["gpt2-dropout"]), SEQ, MBS, 2, cuda=True)
    assert on_cuda.selective_saving == MBS * 4 * SEQ * 4  # flash takes the dropout: nothing (s x s) to save


def test_selective_under_compile_layers_equals_eager():
    """The recomputed core runs between two graphs of a compiled layer (outside_graph): the same values, its
    dropout masks too (eager's: inductor draws other masks for a dropout inside its graph)."""
    model = dict(attention_dropout=0.1)
    eager, compiled = run_layer(config(**model)), run_layer(config("selective", **model), compiled=True)
    for a, b in [(eager[0], compiled[0]), (eager[1], compiled[1]), *zip(eager[2], compiled[2])]:
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()  # inductor's sums: rounding apart
