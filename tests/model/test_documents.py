"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss), single process, fp32.

Isolation against an independent computation: with the three flags the loss of packed sequences equals the
token-weighted mean of each document's loss computed alone (its own sequence, positions from 0), within 1e-5,
for GPT-2, LLaMA (RoPE, grouped K/V), BLOOM (ALiBi) and Qwen3, through the one dense mask and through the
per-document groups of the long path; changing one document's tokens leaves every other document's per-token
losses as they were. Seq1F1B: a document crossing segment boundaries attends to its own earlier segments through
the K/V cache, and segment-wise outputs and gradients equal the whole sequence's. The long path builds no
(s x s) mask and keeps no more for backward than causal attention. The batches follow Megatron's semantics,
checked against a token-by-token walk; perplexity and generation read documents as training did."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.model import GPTConfig, GPTModel, TransformerLayer, gpt_loss
from megatron_ds.model import documents
from megatron_ds.model.chunked_loss import chunked_linear_cross_entropy
from megatron_ds.model.documents import IGNORE, Documents, Packing
from megatron_ds.model.kv_cache import SegmentKVCache

EOD, V, S, B, H = 1, 64, 40, 2, 32
FLAGS = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, eod_token=EOD)
FAMILIES = {
    "gpt2": {},
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, ffn_hidden_size=48),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "qwen3": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  add_bias_linear=False, ffn_hidden_size=48, qk_layernorm=True),
}


def config(family="gpt2", seq=S, **kw):
    return GPTConfig(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4, max_position_embeddings=seq,
                     seed=3, **FAMILIES[family], **kw)


def packed_text(seq=S, seed=0, ends=((5, 6, 20, 33), (12, 39))):
    """(B, seq + 1) tokens: random, with an EOD at each of `ends` per row (two in a row make a 1-token document)."""
    text = torch.randint(2, V, (B, seq + 1), generator=torch.Generator().manual_seed(seed))
    for row, positions in enumerate(ends):
        text[row, list(positions)] = EOD
    return text


def megatron_walk(tokens):
    """Positions and loss mask walked token by token, as Megatron's flags define them: a position counter
    that starts again after each EOD; no loss where the input is an EOD."""
    positions, mask = torch.zeros_like(tokens), torch.ones_like(tokens, dtype=torch.bool)
    for r in range(tokens.shape[0]):
        counter = 0
        for i, t in enumerate(tokens[r].tolist()):
            positions[r, i] = counter
            counter = 0 if t == EOD else counter + 1
            mask[r, i] = t != EOD
    return positions, mask


def test_positions_and_labels_follow_megatron():
    text = packed_text()
    tokens, labels = text[:, :-1], text[:, 1:]
    (x, pos), y = Packing(config(**FLAGS)).batch(tokens, labels)
    positions, mask = megatron_walk(tokens)
    assert torch.equal(x, tokens) and torch.equal(pos, positions)
    assert torch.equal(y, labels.masked_fill(~mask, IGNORE))
    (_, pos), y = Packing(config(**dict(FLAGS, reset_position_ids=False, eod_mask_loss=False))).batch(tokens, labels)
    assert torch.equal(pos, torch.arange(S).expand_as(tokens)) and torch.equal(y, labels)
    assert Packing.of(config()) is None


def documents_alone(model, text, eod=EOD):
    """(summed loss, scored tokens) of every document of `text` computed on its own: its tokens from its first
    to its EOD as the sequence, positions from 0, the prediction at its EOD not scored."""
    total, count = 0.0, 0
    for row in text:
        ends = [i for i in range(len(row) - 1) if row[i] == eod]
        for start, end in zip([0] + [e + 1 for e in ends], ends + [len(row) - 1]):
            inputs, labels = row[start:end + 1][:len(row) - 1 - start], row[start + 1:end + 2]
            labels = labels.masked_fill(inputs == eod, IGNORE)
            if len(inputs) and (labels != IGNORE).any():
                logits = model(inputs[None])[0]
                total += F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE).item()
                count += int((labels != IGNORE).sum())
    return total, count


@pytest.fixture(params=["dense", "grouped"])
def path(request, monkeypatch):
    """The one dense mask, or the long path's groups (a group's keys span at most 8 positions here)."""
    if request.param == "grouped":
        monkeypatch.setattr(documents, "DENSE_SIDE", 8)
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_loss_is_the_mean_of_each_document_alone(family, path):
    text = packed_text()
    packed = config(family, **FLAGS)
    model = GPTModel(packed).eval()
    alone = GPTModel(dataclasses.replace(packed, reset_position_ids=False, reset_attention_mask=False,
                                         eod_mask_loss=False)).eval()
    alone.load_state_dict(model.state_dict())
    with torch.no_grad():
        (x, pos), y = Packing(packed).batch(text[:, :-1], text[:, 1:])
        loss = gpt_loss(model(x, pos), y).item()
        total, count = documents_alone(alone, text)
        without_flags = gpt_loss(alone(x), text[:, 1:]).item()
    assert abs(loss - total / count) <= 1e-5, (loss, total / count)
    assert abs(loss - without_flags) > 1e-4  # the flags change what is computed


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_changing_a_document_leaves_the_others_losses(family, path):
    packed = config(family, **FLAGS)
    model = GPTModel(packed).eval()
    text = packed_text()
    changed = text.clone()
    changed[0, 7:20] = torch.randint(2, V, (13,), generator=torch.Generator().manual_seed(5))  # row 0's 3rd document
    with torch.no_grad():
        losses = []
        for t in (text, changed):
            (x, pos), y = Packing(packed).batch(t[:, :-1], t[:, 1:])
            losses.append(F.cross_entropy(model(x, pos).flatten(0, 1), y.flatten(), reduction="none",
                                          ignore_index=IGNORE).view(B, S))
    others = torch.ones(B, S, dtype=torch.bool)
    others[0, 7:20] = False  # its tokens, and the prediction of its first token from the EOD before it (not scored)
    assert torch.equal(losses[0][others], losses[1][others])
    assert not torch.equal(losses[0][0, 7:20], losses[1][0, 7:20])


def two_layers(family):
    cfg = config(family, seq=64)
    return torch.nn.Sequential(TransformerLayer(cfg, 1), TransformerLayer(cfg, 2))


def run(module, x, grad, docs, lengths=None):
    """Output, input gradient and weight gradients of the layers over x: whole, or Seq1F1B segments of
    `lengths` (forward in order, backward last first, each its own graph)."""
    module.zero_grad()
    if lengths is None:
        x = x.clone().requires_grad_()
        with docs.opened():
            y = module(x)
        y.backward(grad)
        return y.detach(), x.grad, [p.grad.clone() for p in module.parameters()]
    cache, units, start = SegmentKVCache(), [], 0
    for n in lengths:
        xs = x[:, start:start + n].clone().requires_grad_()
        with cache.segment("mb", start, start + n, x.shape[1]), docs.opened():
            units.append((start, n, xs, module(xs)))
        start += n
    for start, n, xs, ys in reversed(units):
        with cache.segment("mb", start, start + n, x.shape[1]), docs.opened():
            ys.backward(grad[:, start:start + n])
    cache.free("mb")
    return (torch.cat([ys.detach() for *_, ys in units], 1), torch.cat([xs.grad for _, _, xs, _ in units], 1),
            [p.grad.clone() for p in module.parameters()])


@pytest.mark.parametrize("family", ["gpt2", "llama", "bloom"])
@pytest.mark.parametrize("lengths", [[32, 32], [16, 16, 8, 24]])
def test_segments_attend_to_their_documents_earlier_segments(family, lengths, path):
    """Documents cross the segment cuts (one runs from 9 to 45, over three segments); the K/V cache's earlier
    positions are masked by their documents as the whole sequence's are."""
    module = two_layers(family)
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(B, 64, H, generator=g), torch.randn(B, 64, H, generator=g)
    text = packed_text(64, ends=((8, 45, 46, 50), (15, 31, 40)))
    positions = Packing(config(family, seq=64, **FLAGS)).positions(text[:, :64])
    docs = Documents(text[:, :64], EOD, positions if family == "llama" else None)
    whole, split = run(module, x, grad, docs), run(module, x, grad, docs, lengths)
    for a, b in zip(whole[:2] + tuple(whole[2]), split[:2] + tuple(split[2])):
        assert (a - b).abs().max().item() <= 1e-5
    plain = run(module, x, grad, Documents(torch.full((B, 64), 2), EOD))  # one document per row: causal attention
    assert (plain[0] - whole[0]).abs().max().item() > 1e-3


def test_the_long_path_makes_no_sequence_square_mask(monkeypatch):
    """Past DENSE_SIDE^2 queries x keys each row's documents are groups: a short ones' group under a mask of at
    most DENSE_SIDE^2, a long document causal with no mask; the whole micro-batch's (s x s) never exists."""
    monkeypatch.setattr(documents, "DENSE_SIDE", 16)
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((None if attn_mask is None else attn_mask.untyped_storage().nbytes(), kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    text = packed_text(256, ends=((3, 4, 9, 200), (100, 101)))
    with torch.no_grad():
        GPTModel(config(seq=256, **FLAGS))(*Packing(config(seq=256, **FLAGS)).batch(text[:, :-1], text[:, 1:])[0])
    assert seen and max(n or 0 for n, _ in seen) <= 16 * 16
    assert any(causal for _, causal in seen)  # the long documents: 190 and 100+ tokens


def test_losses_leave_ignored_labels_out():
    """gpt_loss, the chunked head + loss and a segment's sum / count all score only labels that are not IGNORE."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(B, 12, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (B, 12), generator=g)
    labels[0, 3] = labels[1, 0] = labels[1, 11] = IGNORE
    keep = labels != IGNORE
    expected = F.cross_entropy((hidden @ weight.t())[keep], labels[keep])
    for loss in (gpt_loss(hidden @ weight.t(), labels), chunked_linear_cross_entropy(hidden, weight, labels, 5),
                 gpt_loss(hidden @ weight.t(), (labels, int(keep.sum())))):
        assert abs(loss.item() - expected.item()) <= 1e-5
        (grad,) = torch.autograd.grad(loss, hidden)
        (want,) = torch.autograd.grad(expected, hidden, retain_graph=True)
        assert (grad - want).abs().max().item() <= 1e-6


def test_perplexity_and_generation_read_documents_as_trained():
    """evaluate_stream of a packed model scores each document as if alone; a generated continuation after an EOD
    is the last document's own (greedy: the same tokens as from that document alone)."""
    from megatron_ds.inference.generation import generate
    from megatron_ds.inference.perplexity import evaluate_stream
    packed = config("llama", seq=64, **FLAGS)
    model = GPTModel(packed).eval()
    alone = GPTModel(dataclasses.replace(packed, reset_position_ids=False, reset_attention_mask=False,
                                         eod_mask_loss=False)).eval()
    alone.load_state_dict(model.state_dict())
    stream = packed_text(40)[0]
    with torch.no_grad():
        total, count = documents_alone(alone, stream[None])
        got = evaluate_stream(model, stream.tolist(), 40)
        assert got["tokens"] == count and abs(got["loss"] - total / count) <= 1e-5
        context = stream[:30].tolist()  # the last document starts after the EOD at 20
        assert (generate(model, context, 6, 64, greedy=True) == generate(alone, context[21:], 6, 64, greedy=True))


def test_transformers_scores_each_document_as_the_packed_model():
    """The model exported to Hugging Face (LlamaForCausalLM), each document scored alone by transformers, gives the
    packed model's loss: the documents' isolation against an independent implementation."""
    transformers = pytest.importorskip("transformers")
    from megatron_ds.convert.hf import hf_config_from_gpt, to_hf_state_dict
    packed = config("llama", **FLAGS)
    model = GPTModel(packed).eval()
    hf = transformers.AutoModelForCausalLM.from_config(hf_config_from_gpt(packed)).eval()
    hf.load_state_dict(to_hf_state_dict(model.named_parameters_by_layer(), packed), strict=True)
    text = packed_text()

    class Scored(torch.nn.Module):  # transformers' logits, as documents_alone reads a model's
        def forward(self, tokens):
            return hf(tokens).logits

    with torch.no_grad():
        total, count = documents_alone(Scored(), text)
        (x, pos), y = Packing(packed).batch(text[:, :-1], text[:, 1:])
        loss = gpt_loss(model(x, pos), y).item()
    assert abs(loss - total / count) <= 1e-5, (loss, total / count)


def test_the_long_path_keeps_what_causal_attention_keeps():
    """A layer's tensors saved for backward at 4096 tokens (documents of 1..1000 tokens): document attention's
    long path keeps what causal attention keeps (its groups are attended again in backward)."""
    cfg = config(seq=4096)
    layer = TransformerLayer(cfg, 1)
    tokens = torch.randint(2, V, (1, 4096), generator=torch.Generator().manual_seed(4))
    tokens[0, [700, 701, 705, 1700, 2000, 2010, 2500, 3500]] = EOD

    def saved_bytes(docs):
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), documents.opened(docs):
            layer(torch.randn(1, 4096, H, requires_grad=True))
        return sum(storages.values())

    causal, masked = saved_bytes(None), saved_bytes(Documents(tokens, EOD))
    assert masked <= 1.01 * causal, (masked, causal)


def test_layers_of_an_op_rotate_by_one_pair_of_restarted_positions_tables():
    """RoPE by the documents' restarted positions: the op's layers share one pair of cos/sin tables (b, 1, s, head
    size), as they share positions.rope_tables' without documents, and the op's end lets the documents' memo go."""
    from megatron_ds.model.attention import CausalSelfAttention
    from megatron_ds.model.positions import rope_tables_at
    cfg = config("llama", **FLAGS)
    layers = [CausalSelfAttention(cfg), CausalSelfAttention(cfg)]
    tokens = packed_text()[:, :-1]
    docs = Packing(cfg).documents(tokens, Packing(cfg).positions(tokens))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), docs.opened():
        x = torch.randn(B, S, H, requires_grad=True)
        for layer in layers:
            x = layer(x)
    tables = {t.untyped_storage().data_ptr(): t for t in saved if t.shape == (B, 1, S, cfg.head_dim)}
    assert len(tables) == 2 and not docs._tables  # cos and sin of both layers; the memo gone with the op
    want = rope_tables_at(cfg.head_dim, cfg.rope_theta, Packing(cfg).positions(tokens), torch.float32)
    assert sorted(torch.equal(t, w) for t in tables.values() for w in want) == [False, False, True, True]
