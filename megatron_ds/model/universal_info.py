"""How each parameter of the GPT pipeline is split over tensor-parallel ranks, in the terms of
DeepSpeed's universal checkpoint (deepspeed/checkpoint/constants.py, ds_to_universal.py).

Written into every checkpoint's model states (`universal_checkpoint_info`, as
Megatron-DeepSpeed does); ds_to_universal reads it to merge the TP slices of each parameter
(fp32 master, exp_avg, exp_avg_sq) into the whole tensor, and DeepSpeed's ZeRO-1 loader
(universal_checkpoint.load_hp_checkpoint_state) cuts it again for the TP size that loads it.
The patterns are regexes over the PipelineModule's parameter names, whose first part is the
global layer index (gpt.py): 0 embedding, 1..L transformer layers, L+1 final norm, L+2 the
untied LM head; a tied head shares "tied_modules.embed.*" with the embedding.

- replicated: the same on every TP rank (norms, --qk-layernorm's per-head norms too, learned positions,
  row-parallel biases, a MoE's router and experts);
- row-parallel: split along the input dimension (c_proj weights);
- QKV: [q; k; v] with grouped K/V heads, each rank holding its slice of each section
  (layers.shard with sections), so its own widths per section (SUB_PARAM_SHARD_WIDTHS);
- SwiGLU's c_fc: [gate; up], each rank its slice of both (two sub-params, cat dim 0);
- vocabulary: the word embedding and the LM head. The whole padded vocabulary is kept
  (ORIGINAL_VOCAB_SIZE = the saved padded size): the padding rows are trained parameters
  that enter the softmax, so dropping them would change the model. A run that loads it
  with a larger padding gets zero rows added (DeepSpeed's loader); a smaller one is refused.
"""
import re

from deepspeed.checkpoint import constants as C

from .vocab_slices import whole_names

LAYER = r"\d+"


def layer_parameters(config):
    """{(global layer index, local name): (kind, sections or None)} of the whole model, TP-independent.

    kind: "replicated", "row" (split along dim 1), "column" (dim 0), "vocab" (dim 0, padded
    vocabulary), "qkv" and "swiglu" (dim 0, each rank its slice of every section)."""
    L, bias = config.num_layers, config.add_bias_linear
    norm = ["weight"] if config.normalization == "rmsnorm" else ["weight", "bias"]
    out = {(0, "wte.weight"): ("vocab", None)}
    if config.position_embedding_type == "learned_absolute":
        out[(0, "wpe.weight")] = ("replicated", None)
    if config.embed_layernorm:
        out.update({(0, f"ln_emb.{p}"): ("replicated", None) for p in norm})
    q = config.query_projection_size
    kv = (config.num_key_value_heads or config.num_attention_heads) * config.head_dim
    layer = {f"ln_{i}.{p}": ("replicated", None) for i in (1, 2) for p in norm}
    if config.qk_layernorm:  # each rank holds whole heads and the whole per-head weight
        layer.update({f"attn.{qk}_norm.{p}": ("replicated", None) for qk in "qk" for p in norm})
    layer.update({"attn.c_attn.weight": ("qkv", (q, kv, kv)), "attn.c_proj.weight": ("row", None)})
    if bias:
        layer.update({"attn.c_attn.bias": ("qkv", (q, kv, kv)), "attn.c_proj.bias": ("replicated", None)})
    for i in range(1, L + 1):
        mlp = _moe_parameters(config) if config.is_moe_layer(i) else _mlp_parameters(config, "mlp", config.ffn_hidden_size)
        out.update({(i, n): kind for n, kind in {**layer, **mlp}.items()})
    out.update({(L + 1, p): ("replicated", None) for p in norm})
    if not config.tied_head:
        out[(L + 2, "weight")] = ("vocab", None)
    return out


def _mlp_parameters(config, prefix, ffn):
    """An MLP split over TP ranks (the dense one, a MoE's shared expert): c_fc column-parallel, c_proj row."""
    fc = ("swiglu", (ffn, ffn)) if config.swiglu else ("column", None)
    out = {f"{prefix}.c_fc.weight": fc, f"{prefix}.c_proj.weight": ("row", None)}
    if config.add_bias_linear:
        out.update({f"{prefix}.c_fc.bias": fc, f"{prefix}.c_proj.bias": ("replicated", None)})
    return out


def _moe_parameters(config):
    """A MoE layer's: the router and every expert whole on each TP rank (experts are not split over TP), the
    shared expert split as the dense MLP. The expert bias is a buffer, in the layer files alone."""
    m = config.moe
    out = {"mlp.router.weight": ("replicated", None)}
    for e in range(m.num_experts):
        for fc in ("fc1", "fc2"):
            out.update({f"mlp.experts.{e}.{fc}.{p}": ("replicated", None)
                        for p in (("weight", "bias") if config.add_bias_linear else ("weight",))})
    if m.shared_expert_intermediate_size:
        out.update(_mlp_parameters(config, "mlp.shared_expert", m.shared_expert_intermediate_size))
    return out


def parameter_names(config):
    """{PipelineModule parameter name: (kind, sections)}: a tied embedding lives under tied_modules.embed."""
    embed = "tied_modules.embed" if config.tied_head else "0"
    return {f"{embed if idx == 0 else idx}.{name}": kind for (idx, name), kind in layer_parameters(config).items()}


def _pattern(name):
    """A transformer layer's parameter: any layer index; the others: their exact name."""
    head, _, rest = name.partition(".")
    if rest.startswith(("ln_1", "ln_2", "attn.", "mlp.")):
        return rf"^{LAYER}\.{re.escape(rest)}$"
    return rf"^{re.escape(name)}$"


def vocab_parallel_names(config):
    """{name without vocabulary parallelism: its name under it} for the parameters it renames
    (model/vocab_slices.whole_names, inverted): the slices, and tied, layer 0's other parameters."""
    names = whole_names(config)
    out = {whole: sliced for sliced, whole in names["slices"].items()}
    for name in parameter_names(config):
        for prefix, replacement in names["prefixes"].items():
            if name not in out and name.startswith(replacement):
                out[name] = prefix + name[len(replacement):]
    return out


def universal_checkpoint_info(config, padded_vocab_size, vocab_parallel=False):
    """The UNIVERSAL_CHECKPOINT_INFO dict for a model of `config` (its tensor_model_parallel_size
    is the TP size the checkpoint is saved with). `vocab_parallel`: the step's optimizer shards hold
    vocabulary slices (model/vocab_slices.py) under names every pipeline rank shares; the patterns
    name them so, and mark them pipeline-replicated, so that DeepSpeed's converter extracts pipeline
    rank 0's alone instead of writing every rank's over one another: training/checkpoint/universal.py's
    converter then puts the whole parameters in their place."""
    tp = config.tensor_model_parallel_size
    renamed = vocab_parallel_names(config) if vocab_parallel else {}
    kinds = {}
    sub_params = {}
    for name, (kind, sections) in parameter_names(config).items():
        pattern = _pattern(renamed.get(name, name))
        kinds.setdefault(kind, [])
        if pattern not in kinds[kind]:
            kinds[kind].append(pattern)
        if kind == "qkv":
            sub_params[pattern] = sections
    vocab = kinds.get("vocab", [])
    return {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.ORIGINAL_VOCAB_SIZE: padded_vocab_size,
        C.PADDED_VOCAB_SIZE: padded_vocab_size,
        C.VOCABULARY_PARAMETER_PATTERNS: vocab,
        C.PIPELINE_REPLICATED_PARAMETER_PATTERNS: vocab if vocab_parallel else [p for p in vocab if "tied_modules" in p],
        C.TP_REPLICATED_PARAMETER_PATTERNS: kinds.get("replicated", []),
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: kinds.get("row", []),
        C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: kinds.get("swiglu", []),
        C.PARAMETER_WITH_SUB_PARAMS: [
            {"patterns": [pattern], "shape": (tuple(sections), -1) if pattern.endswith(r"weight$") else
             (tuple(sections),), "partition_dim": 0} for pattern, sections in sub_params.items()],
        C.SUB_PARAM_SHARD_WIDTHS: {pattern: [[s // tp] * tp for s in sections]
                                   for pattern, sections in sub_params.items()},
    }
