"""GPT hyper-parameters, named as Megatron's flags.

The defaults are GPT-2. The other families are options on the same layers:
LLaMA = rmsnorm + swiglu + rope + grouped-query attention + untied head + no linear biases,
BLOOM = alibi + embedding layernorm (GELU, tied head, biases as GPT-2),
Qwen3 = LLaMA + a norm of each query and key head (qk_layernorm), often with heads wider than hidden / heads
(kv_channels: HF's head_dim, as Qwen3-30B-A3B's 128 at 2048 / 32),
Mixtral = LLaMA + experts in every layer (moe), Qwen3-MoE = Qwen3 + experts.
LLaMA 3.1 = LLaMA + rope_scaling llama3; Qwen's long-context configs = Qwen3 + rope_scaling yarn (rope_scaling.py).
Packed documents (Megatron's --reset-position-ids, --reset-attention-mask, --eod-mask-loss) are options
too: they change what attention sees and what the loss scores (model/documents.py).
"""
from dataclasses import dataclass
from typing import Optional

from .cp_section import flags_problem
from .moe_config import MoEConfig, hf_moe_family, moe_problem, with_ffn_default
from .parallel_layout import check_model_split, hierarchical_problem
from .rope_scaling import RopeScaling, rope_scaling_problem

NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "alibi")


@dataclass
class GPTConfig:
    vocab_size: int  # already padded (Megatron's padded_vocab_size)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    ffn_hidden_size: int = 0  # 0: 4 * hidden_size (swiglu: Megatron's 2/3 of that, a multiple of 64)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    seed: int = 1234  # every layer draws its initial weights from seed + its global layer index
    normalization: str = "layernorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rope_theta: float = 10000.0
    # long-context RoPE scaling (linear, llama3, yarn; rope_scaling.py): None rotates by rope_theta's frequencies
    # alone. Its dict form (HF's rope_parameters) is taken too and made the frozen RopeScaling
    rope_scaling: Optional[RopeScaling] = None
    num_key_value_heads: int = 0  # 0: one K/V head per query head (no grouping)
    # the head size where it is not hidden_size // num_attention_heads (Megatron's --kv-channels, HF's head_dim:
    # Qwen3's 128 at hidden 2048 / 32 heads); the same as that is kept as None, so that one model has one config
    kv_channels: Optional[int] = None
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    embed_layernorm: bool = False
    qk_layernorm: bool = False  # each query and key head normalised (over head_dim) before RoPE (Qwen3)
    tensor_model_parallel_size: int = 1  # the layers split heads, MLP columns and vocabulary over this many ranks
    sequence_parallel: bool = False  # and, outside attention and MLP, the sequence
    # context parallelism: each sequence split over this many ranks (model/context_parallel/), attention
    # exchanging keys and values by "p2p" (a ring), "allgather", "a2a" (heads <-> sequence, Ulysses) or "a2a+p2p"
    # (hierarchical: a2a within groups of A consecutive CP ranks, a ring over the P groups; sizes (A, P))
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    hierarchical_context_parallel_sizes: Optional[tuple] = None
    loss_chunk_size: int = 0  # > 0: the pipeline's LM head and loss run this many tokens at a time (chunked_loss.py)
    liger_kernel: bool = False  # the LM head and loss as Liger-Kernel's fused linear cross-entropy (CUDA)
    moe: Optional[MoEConfig] = None  # experts in place of the MLP of the layers moe.layer_freq picks
    reset_position_ids: bool = False  # positions restart after each end-of-document token
    reset_attention_mask: bool = False  # a token attends to its own document only
    eod_mask_loss: bool = False  # the prediction made at an end-of-document token is not scored
    eod_token: Optional[int] = None  # the tokenizer's end-of-document id (known once it is built)
    # Megatron's recompute (pipe/plan/recompute.py): "selective" attends again in backward (model/recompute.py);
    # "full" recomputes whole layers, the pipeline module checkpointing them by method "uniform" (groups of
    # recompute_num_layers) or "block" (the first recompute_num_layers of each virtual stage)
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None

    @property
    def packs_documents(self):
        """Whether any of the three document flags is on (the batches then mark their documents)."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    @property
    def documents_in_every_stage(self):
        """Whether every pipeline stage needs the micro-batch's documents, not only the embedding and the loss:
        attention masks by document, or rotates by positions that restart (learned positions are added once,
        in the embedding)."""
        return self.reset_attention_mask or (self.reset_position_ids and self.position_embedding_type == "rope")

    @property
    def head_hands_weight(self):
        """The head gives the loss (hidden, weight), which multiplies them itself (never the whole logits)."""
        return bool(self.loss_chunk_size or self.liger_kernel)

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling.from_dict(self.rope_scaling)
        if isinstance(self.hierarchical_context_parallel_sizes, list):  # as a saved config's JSON holds it
            self.hierarchical_context_parallel_sizes = tuple(self.hierarchical_context_parallel_sizes)
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            self.kv_channels = None
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        if not self.ffn_hidden_size:
            self.ffn_hidden_size = 4 * self.hidden_size
            if self.swiglu:  # Megatron: the same parameter count over three matrices instead of two
                self.ffn_hidden_size = max(64, int(4 * self.hidden_size * 2 / 3) // 64 * 64)
        if self.moe is not None:
            self.moe = with_ffn_default(self.moe, self.ffn_hidden_size)
        problem = config_problem(self)
        if problem:
            raise ValueError(problem)
        check_model_split(self.tensor_model_parallel_size, self.num_attention_heads, self.ffn_hidden_size,
                          self.vocab_size, self.num_key_value_heads, self.sequence_parallel)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether the transformer layer of global pipeline index `layer_idx` (1..L) has experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer_idx - 1, self.num_layers)

    @property
    def head_dim(self):
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_projection_size(self):
        """The width of the queries and of the attention's output, heads x head_dim (Megatron's name): the
        hidden size unless --kv-channels sets another head size."""
        return self.num_attention_heads * self.head_dim

    @property
    def tied_head(self):
        return not self.untie_embeddings_and_output_weights

    @property
    def family(self):
        """The Hugging Face model family these options make ("gpt2", "llama", "bloom", "qwen3", "mixtral",
        "qwen3_moe"), None for another mix. Any family may have its LM head tied or not (HF's tie_word_embeddings)."""
        return hf_family(self)[0]


def hf_family(c):
    """(The Hugging Face family of GPTConfig `c`, or None and what keeps it from one: '' when nothing says more.)"""
    layout = (c.normalization, c.position_embedding_type, c.swiglu, c.embed_layernorm)
    llama = layout == ("rmsnorm", "rope", True, False)
    if c.moe is not None or c.qk_layernorm:
        if not llama or c.add_bias_linear:  # Qwen3's MLP has no biases, Mixtral none at all
            what = "experts (Mixtral, Qwen3-MoE)" if c.moe is not None else "--qk-layernorm (Qwen3)"
            return None, (f"{what}: Hugging Face has them on LLaMA's layout without biases (--normalization rmsnorm "
                          "--swiglu --position-embedding-type rope --disable-bias-linear)")
        if c.moe is None:
            return "qwen3", ""
        return hf_moe_family(c.moe, c.num_layers, c.qk_layernorm)
    if llama:
        return "llama", ""  # HF LLaMA also has attention_bias/mlp_bias and num_key_value_heads
    mha_with_biases = c.add_bias_linear and c.num_key_value_heads == c.num_attention_heads
    gpt2 = layout == ("layernorm", "learned_absolute", False, False) and mha_with_biases
    bloom = layout == ("layernorm", "alibi", False, True) and mha_with_biases and c.ffn_hidden_size == 4 * c.hidden_size
    if (gpt2 or bloom) and c.kv_channels is not None:
        return None, (f"--kv-channels {c.kv_channels}: Hugging Face's GPT-2 and BLOOM have no head size of their "
                      "own (hidden / heads)")
    return ("gpt2" if gpt2 else "bloom" if bloom else None), ""


def head_size_text(c) -> str:
    """The head size of GPTConfig or parsed flags `c` as the flags give it, for a message."""
    if getattr(c, "kv_channels", None) is not None:
        return f"--kv-channels {c.kv_channels}"
    return f"--hidden-size {c.hidden_size} / --num-attention-heads {c.num_attention_heads}"


def config_problem(c) -> str:
    """What makes this set of model options impossible (named by flag), or '' when they work.
    `c` is a GPTConfig or anything with its attribute names (the parsed flags)."""
    heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    if c.hidden_size % heads:
        return f"--hidden-size ({c.hidden_size}) must be divisible by --num-attention-heads ({heads})"
    if kv < 1 or heads % kv:
        return (f"--num-attention-heads ({heads}) must be divisible by --num-key-value-heads ({kv}): "
                "each K/V head serves a whole group of query heads")
    if c.normalization not in NORMALIZATIONS:
        return f"--normalization {c.normalization!r}: choose one of {', '.join(NORMALIZATIONS)}"
    if c.position_embedding_type not in POSITION_EMBEDDINGS:
        return f"--position-embedding-type {c.position_embedding_type!r}: choose one of {', '.join(POSITION_EMBEDDINGS)}"
    kv_channels = getattr(c, "kv_channels", None)
    if kv_channels is not None and (not isinstance(kv_channels, int) or kv_channels < 1):
        return f"--kv-channels (the head size) must be a positive whole number, got {kv_channels!r}"
    if c.position_embedding_type == "rope" and (kv_channels or c.hidden_size // heads) % 2:
        return (f"--position-embedding-type rope rotates pairs of channels: the head size ({head_size_text(c)}) "
                "must be even")
    chunk = getattr(c, "loss_chunk_size", 0) or 0
    if not isinstance(chunk, int) or chunk < 0:
        return f"--loss-chunk-size must be a whole number of tokens >= 0 (0: off), got {chunk!r}"
    if getattr(c, "liger_kernel", False) and chunk:
        return "--use-liger-kernel and --loss-chunk-size both fuse the LM head with its loss: give one"
    if getattr(c, "liger_kernel", False) and c.tensor_model_parallel_size > 1:
        return ("--use-liger-kernel: Liger's fused linear cross-entropy takes the whole vocabulary; with "
                "--tensor-model-parallel-size > 1 use --loss-chunk-size (vocabulary-parallel)")
    if c.position_embedding_type == "rope" and not c.rope_theta > 0:
        return f"--rope-theta must be positive, got {c.rope_theta}"
    scaling = getattr(c, "rope_scaling", None)
    if scaling is not None and c.position_embedding_type != "rope":
        return (f"RoPE scaling (--rope-scaling-type / --use-rope-scaling) scales rotary positions: "
                f"--position-embedding-type is {c.position_embedding_type}, not rope")
    if scaling is not None and rope_scaling_problem(scaling):
        return rope_scaling_problem(scaling)
    eod = getattr(c, "eod_token", None)
    if eod is not None and not 0 <= eod < (c.vocab_size or eod + 1):
        return f"the end-of-document token {eod} is not in the vocabulary of {c.vocab_size} ids"
    cp, cp_comm = getattr(c, "context_parallel_size", None), getattr(c, "cp_comm_type", None) or "p2p"
    cp = 1 if cp is None else cp  # flags read before their merge with the ds_config, or saved before CP existed
    if flags_problem(cp, cp_comm):
        return flags_problem(cp, cp_comm)
    tp = getattr(c, "tensor_model_parallel_size", None) or 1
    if cp > 1 and cp_comm == "a2a" and (kv // tp) % cp:
        return (f"--cp-comm-type a2a shares the attention heads out over the context-parallel ranks: the "
                f"{kv} K/V heads{f' / TP {tp}' if tp > 1 else ''} must be divisible by --context-parallel-size "
                f"({cp}); use --cp-comm-type p2p or allgather")
    sizes = getattr(c, "hierarchical_context_parallel_sizes", None)
    if hierarchical_problem(cp, cp_comm, sizes):
        return hierarchical_problem(cp, cp_comm, sizes)
    if cp > 1 and cp_comm == "a2a+p2p" and (kv // tp) % sizes[0]:
        return (f"--cp-comm-type a2a+p2p shares the attention heads out over the first of "
                f"--hierarchical-context-parallel-sizes: the {kv} K/V heads{f' / TP {tp}' if tp > 1 else ''} must be "
                f"divisible by {sizes[0]}")
    if getattr(c, "moe", None) is not None:
        return moe_problem(c.moe, c.num_layers, c.tensor_model_parallel_size)
    return ""
