"""RoPE scaling (linear, llama3, yarn) in the layers. The inverse frequencies and attention factor equal
transformers' own rope init functions bit for bit, for every type, head sizes and parameters; the cos/sin tables
equal transformers' rotary embedding's (yarn's attention factor on both); and every RoPE path takes them: the
tables of a packed document's restarted positions are the whole sequence's bit for bit, Seq1F1B segments equal
the unsegmented layers (forward, input and weight gradients, 1e-5), packed documents score as each document alone
(1e-5), and a compiled layer equals the eager one."""
import dataclasses

import pytest
import torch

from megatron_ds.model import GPTModel, gpt_loss
from megatron_ds.model.documents import Packing
from megatron_ds.model.positions import inverse_frequencies, rope_tables, rope_tables_at
from megatron_ds.rope_scaling import RopeScaling
from tests.model import test_documents as docs
from tests.model.test_segment_attention import FAMILIES, compare, full_run, inputs, two_layers

transformers = pytest.importorskip("transformers")

SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "llama3-31": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),  # LLaMA 3.1's own
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn-qwen": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),  # Qwen's long context
    "yarn-betas-mscale": dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=64, beta_fast=8.0,
                              beta_slow=0.5, mscale=0.9, mscale_all_dim=0.5),
    "yarn-attention-factor": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16,
                                  attention_factor=1.3),
}
THETAS = {"linear": 1e4, "llama3": 500.0, "llama3-31": 5e5, "yarn": 1e4, "yarn-qwen": 1e6, "yarn-betas-mscale": 1e3,
          "yarn-attention-factor": 1e4}


def hf_config(name, head_dim, max_positions=128):
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=max_positions,
                                    rope_parameters={**SCALINGS[name], "rope_theta": THETAS[name]})


@pytest.mark.parametrize("head_dim", [8, 16, 128])
@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_equal_transformers_rope_init(name, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = hf_config(name, head_dim, max_positions=4 * SCALINGS[name].get("original_max_position_embeddings", 32))
    theirs, their_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, "cpu")
    scaling = RopeScaling.from_dict(SCALINGS[name])
    mine = inverse_frequencies(head_dim, THETAS[name], scaling)
    assert mine.dtype == theirs.dtype == torch.float32
    assert torch.equal(mine, theirs), (mine - theirs).abs().max()
    assert scaling.attention_scale == their_factor
    unscaled = inverse_frequencies(head_dim, THETAS[name])
    assert not torch.equal(mine, unscaled) and (mine <= unscaled).all()  # some turn slower, none faster


@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn-betas-mscale"])
def test_tables_equal_transformers_rotary_embedding(name):
    """cos and sin of positions 0..95 (yarn's times its attention factor), bit for bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rotary = LlamaRotaryEmbedding(hf_config(name, 16))
    positions = torch.arange(96)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    mine = rope_tables(16, THETAS[name], 0, 96, torch.device("cpu"), torch.float32, RopeScaling.from_dict(SCALINGS[name]))
    assert torch.equal(mine[0], cos[0]) and torch.equal(mine[1], sin[0])


@pytest.mark.parametrize("name", ["llama3", "yarn-betas-mscale"])
def test_restarted_positions_take_the_same_tables(name):
    """Packed documents' tables (rope_tables_at of each token's position) are rope_tables' rows, bit for bit."""
    scaling = RopeScaling.from_dict(SCALINGS[name])
    whole = rope_tables(16, THETAS[name], 0, 40, torch.device("cpu"), torch.float32, scaling)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]])
    at = rope_tables_at(16, THETAS[name], positions, torch.float32, scaling)
    for table, rows in zip(whole, at):
        assert torch.equal(rows[:, 0], table[positions])
    segment = rope_tables(16, THETAS[name], 30, 10, torch.device("cpu"), torch.float32, scaling)
    assert torch.equal(segment[0], whole[0][30:]) and torch.equal(segment[1], whole[1][30:])


LARGE = dict(FAMILIES["llama"], init_method_std=0.1)  # weights large enough that attention is far from uniform


def _scaled(name):
    return dict(LARGE, rope_scaling=RopeScaling.from_dict(SCALINGS[name]))


@pytest.mark.parametrize("lengths", [[32, 32], [16, 16, 8, 24]])
@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn-betas-mscale"])
def test_segments_equal_the_whole_sequence_under_scaling(name, lengths):
    compare(lambda: two_layers(**_scaled(name)), lengths, defer=True)
    x, g = inputs()
    scaled, plain = full_run(two_layers(**_scaled(name)), x, g), full_run(two_layers(**LARGE), x, g)
    assert (scaled[0] - plain[0]).abs().max().item() > 1e-2  # the segments ran the scaled tables


@pytest.mark.parametrize("name", ["llama3", "yarn-attention-factor"])
def test_packed_documents_score_as_each_alone_under_scaling(name):
    """Documents restart their positions (rope_tables_at): with the scaling they score as alone (rope_tables)."""
    rope = dict(SCALINGS[name], **({"original_max_position_embeddings": 8} if "original_max_position_embeddings"
                                   in SCALINGS[name] else {}))
    packed = docs.config("llama", **docs.FLAGS, rope_scaling=RopeScaling.from_dict(rope), init_method_std=0.3)
    model = GPTModel(packed).eval()
    alone = GPTModel(dataclasses.replace(packed, reset_position_ids=False, reset_attention_mask=False,
                                         eod_mask_loss=False)).eval()
    alone.load_state_dict(model.state_dict())
    plain = GPTModel(dataclasses.replace(packed, rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    text = docs.packed_text()
    with torch.no_grad():
        (x, pos), y = Packing(packed).batch(text[:, :-1], text[:, 1:])
        loss = gpt_loss(model(x, pos), y).item()
        total, count = docs.documents_alone(alone, text)
        unscaled = gpt_loss(plain(x, pos), y).item()
    assert abs(loss - total / count) <= 1e-5, (loss, total / count)
    assert abs(loss - unscaled) > 1e-3


def test_compiled_layers_take_the_scaling():
    """A compiled layer computes its tables in its graph (positions.rope_tables): the scaled ones."""
    from torch._dynamo.utils import counters
    from megatron_ds.model import TransformerLayer
    from megatron_ds.model.compile import compile_layers
    from tests.model.test_segment_attention import config
    x = inputs()[0]
    layer, plain = TransformerLayer(config(**_scaled("yarn")), 1).eval(), TransformerLayer(config(**LARGE), 1).eval()
    with torch.no_grad():
        eager, unscaled = layer(x), plain(x)
        compile_layers([layer], defer_weight_grads=False)
        graphs = counters["stats"]["unique_graphs"]
        compiled = layer(x)
    assert counters["stats"]["unique_graphs"] > graphs  # it ran compiled
    assert (compiled - eager).abs().max().item() <= 1e-5
    assert (compiled - unscaled).abs().max().item() > 1e-2
