"""megatron_ds.pipe.hf on one process: the cut of each family (found from the model's own structure) run layer
after layer gives the model's own logits, our attention's masks (packed documents, sliding windows) equal
attention over each document alone, a local folder loads, and a model the cut cannot place is refused with
one line naming why."""
import pytest
import torch

from megatron_ds.errors import UserError
from megatron_ds.pipe.hf import CutError, load
from megatron_ds.pipe.hf import attention as attn
from megatron_ds.pipe.hf.cut import Parts, check_cut, sequential
from megatron_ds.pipe.hf.layers import HFTransformerLayer, HFEmbedding, HFHead, HFNorm, HFPositions
from tests.hf_harness import SIZES, build, config

FAMILIES = ["llama", "qwen3", "mistral", "gemma3", "phi3", "olmo2", "mixtral", "gpt2"]


def _other(name):
    """Tiny configs of families the engine tests leave out."""
    import transformers as T
    if name == "gemma2":  # attention logits capped (softcap): our eager path
        return T.Gemma2Config(**SIZES, head_dim=8, sliding_window=4)
    if name == "qwen3_moe":
        return T.Qwen3MoeConfig(**SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return T.OlmoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("family", FAMILIES + ["gemma2", "qwen3_moe", "olmoe"])
def test_the_cut_gives_the_models_logits(family):
    """On two rows of packed documents (positions restarting), in the model's own attention and then under ours
    set as the model's implementation: the model's logits, the cut's, and each document run alone agree."""
    torch.manual_seed(0)
    model = build(family) if family in FAMILIES else load(_other(family))
    parts = Parts(model)
    layers = parts.layer_list()
    assert isinstance(layers[0], (HFEmbedding, type(layers[-1]))) and isinstance(layers[-2], HFNorm)
    # GPT-2: its learned positions and embedding dropout in a layer after the (tied) token embedding
    assert [type(x) for x in layers[1:-2]] == [HFPositions] * (family == "gpt2") + [HFTransformerLayer] * 4
    assert parts.tied == (family in ("llama", "gemma3", "gemma2", "gpt2")) and isinstance(layers[-1], HFHead) != parts.tied
    ids = torch.randint(0, 64, (2, 14))
    positions = torch.tensor([list(range(9)) + list(range(5)), list(range(3)) + list(range(11))])
    model.eval()
    with torch.no_grad():
        own = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([torch.cat([model(input_ids=ids[r:r + 1, a:b], use_cache=False).logits
                                      for a, b in bounds], dim=1) for r, bounds in enumerate([[(0, 9), (9, 14)],
                                                                                              [(0, 3), (3, 14)]])])
        check_cut(model, layers)  # sets our attention
        assert model.config._attn_implementation == attn.NAME
        cut = sequential(layers)((ids, positions))
        ours = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    for name, got in (("own", own), ("cut", cut), ("ours", ours)):
        diff = (got - alone).abs().max().item()
        assert diff < 2e-5, (family, name, diff)


def test_masks_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    assert attn.documents(pos).tolist() == [[0, 0, 0, 1, 1, 1, 1], [0] * 7]
    assert attn.mask_from_positions(pos[1:], 7) is None  # one document: plain causal
    assert attn.mask_from_positions(pos[1:], 7, window=7) is None  # a window that does not bite
    windowed = attn.mask_from_positions(pos[1:], 7, window=3)[0, 0]
    assert windowed[6].tolist() == [False] * 4 + [True] * 3 and windowed[1].tolist() == [True] * 2 + [False] * 5
    packed = attn.mask_from_positions(pos, 7)
    assert packed.shape == (2, 1, 7, 7)
    assert packed[0, 0, 4].tolist() == [False, False, False, True, True, False, False]
    assert packed[1, 0].equal(torch.ones(7, 7, dtype=torch.bool).tril())


def test_our_attention_is_causal_sdpa_per_document():
    """Grouped heads, packed rows: each document's output is SDPA's causal attention over that document alone."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    out, weights = attn.attention(module, q, k, v, None, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1]]))
    assert weights is None and out.shape == (1, 6, 4, 8)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for a, b in ((0, 4), (4, 6)):
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], kk[:, :, a:b], vv[:, :, a:b],
                                                                is_causal=True).transpose(1, 2)
        assert torch.allclose(out[:, a:b], want, atol=1e-6)


def test_a_local_folder_loads_with_the_same_weights(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path)
    again = load(tmp_path)
    mine = dict(again.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in model.named_parameters())
    assert Parts(again).tied


def _refusal(model_or_source):
    with pytest.raises(CutError) as info:
        Parts(load(model_or_source))
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    return message


def test_what_the_cut_cannot_place_is_refused_in_one_line(tmp_path):
    import transformers as T
    assert _refusal(T.BertForMaskedLM(T.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=64, vocab_size=64))).startswith(
        "BertForMaskedLM is not a causal LM")
    bloom = _refusal(T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64))
    assert bloom.startswith("BloomForCausalLM: its base model holds 2 modules with weights besides the embedding "
                            "and the decoder layers (['word_embeddings_layernorm', 'ln_f'])"), bloom
    router = config("mixtral")
    router.output_router_logits = True
    assert "output_router_logits" in _refusal(router)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CutError, match=f"^{tmp_path}: not a Hugging Face causal LM folder"):
        load(tmp_path)


def test_a_forward_the_cut_does_not_know_is_refused():
    """A family whose forward does more than its parts (here a logit scale in the causal LM's forward, as
    Cohere's) gives other logits than its cut: refused."""
    model = build("llama")
    forward = type(model).forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 0.5
        return out
    model.forward = scaled.__get__(model)
    with pytest.raises(CutError, match="do not give the model's logits"):
        check_cut(model, Parts(model).layer_list())


def test_save_pretrained_writes_a_new_folder_only(tmp_path):
    from megatron_ds.pipe.hf.save import check_new_folder
    assert check_new_folder(tmp_path / "new") == str(tmp_path / "new")
    with pytest.raises(CutError, match="already exists"):
        check_new_folder(tmp_path)
    with pytest.raises(CutError, match="no such folder"):
        check_new_folder(tmp_path / "a" / "b")


def test_a_seq1f1b_segments_mask():
    """Segment [4, 7) of a sequence: query i (position 4 + i) sees keys 0..4 + i, and a window 3 back of it."""
    mask = attn.segment_mask(torch.tensor([[4, 5, 6]]), 4, 3, 7)
    assert mask.tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]
    windowed = attn.segment_mask(None, 4, 3, 7, window=3)
    assert windowed.tolist()[0] == [False, False, True, True, True, False, False]
    with pytest.raises(attn.AttentionError, match="without the micro-batch's documents open"):
        attn.segment_mask(torch.tensor([[4, 0, 1]]), 4, 3, 7)  # a document starting inside the segment


def test_a_segment_sees_the_cached_keys_of_its_own_document():
    """With the micro-batch's documents open (the engine's PositionDocuments of its whole position ids), segment
    [4, 7) of the rows 0 1 2 3 4 | 0 1 and 0 1 | 0 1 2 3 4: each query sees the earlier keys of its document only,
    the second row's document begun in the earlier segment too."""
    from megatron_ds.model.documents import opened
    whole = torch.tensor([[0, 1, 2, 3, 4, 0, 1], [0, 1, 0, 1, 2, 3, 4]])
    docs = attn.PositionDocuments.of(whole)
    assert docs.ids.tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert docs.starts == [[0, 5], [0, 2]]
    with opened(docs):
        mask = attn.segment_mask(whole[:, 4:], 4, 3, 7)
    assert mask.shape == (2, 1, 3, 7)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1]]
    assert mask[1, 0].int().tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]]
    with opened(attn.PositionDocuments.of(whole)):
        windowed = attn.segment_mask(whole[:, 4:], 4, 3, 7, window=2)
    assert windowed[1, 0, 2].int().tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert attn.PositionDocuments.of(torch.arange(7).repeat(2, 1)) is None  # one document a row: plain causal


@pytest.mark.parametrize("family,cp,comm,seq,message", [
    ("mistral", 2, "p2p", 16, "a sliding window (4 tokens, shorter than the sequence) under --context-parallel-size 2"),
    ("gemma2", 2, "allgather", 16, "a sliding window"),
    ("llama", 4, "a2a", 16, "2 K/V heads per tensor-parallel rank do not divide by --context-parallel-size 4"),
])
def test_what_context_parallelism_cannot_run_is_refused(family, cp, comm, seq, message):
    from megatron_ds.pipe.hf.engine import context_problem
    cfg = _other(family) if family == "gemma2" else config(family)
    assert message in context_problem(cfg, cp, comm, seq)
    assert context_problem(cfg, 1, comm, seq) == ""


def test_what_context_parallelism_runs_is_not_refused():
    """No window, or one no shorter than the sequence; a2a where the K/V heads divide by CP; capped scores refused
    alone."""
    import transformers as T
    from megatron_ds.pipe.hf.engine import context_problem
    assert context_problem(config("llama"), 2, "a2a", 16) == ""
    assert context_problem(config("qwen3"), 2, "p2p", 16) == ""
    assert context_problem(T.MistralConfig(**SIZES, sliding_window=16), 2, "p2p", 16) == ""
    capped = T.Gemma2Config(**SIZES, head_dim=8, sliding_window=16)
    assert "capped attention scores" in context_problem(capped, 2, "p2p", 16)


@pytest.mark.parametrize("family,ffn,gated", [("llama", 64, True), ("gpt2", 128, False), ("qwen3", 64, True),
                                              ("phi3", 64, True), ("gpt_neox", 64, False), ("mixtral", 64, True)])
def test_plan_sizes_read_the_models_config(family, ffn, gated):
    """What "auto" and Seq1F1B's balanced cut weigh: layers, sizes, vocabulary and the sequence from the config;
    a gated MLP where the layers hold a gate projection (LLaMA's gate_proj, Phi-3's fused gate_up_proj, Mixtral's
    experts' beside its router), not where the config names intermediate_size for an ungated one (GPT-NeoX's
    dense_h_to_4h) or n_inner (GPT-2's 4 h, n_inner None)."""
    import transformers as T
    from megatron_ds.pipe.hf.engine import plan_sizes
    made = T.GPTNeoXConfig(**{k: v for k, v in SIZES.items() if k != "num_key_value_heads"}, hidden_dropout=0.0) \
        if family == "gpt_neox" else config(family)
    sizes = plan_sizes(load(made), 16)
    assert (sizes.num_layers, sizes.hidden_size, sizes.vocab_size, sizes.max_position_embeddings) == (4, 32, 64, 16)
    assert (sizes.ffn_hidden_size, sizes.swiglu) == (ffn, gated)
    assert sizes.num_key_value_heads == (4 if family in ("gpt2", "gpt_neox") else 2)  # one K/V head per query head
