"""Model-family flags (Megatron-DeepSpeed / Megatron-LM names, BigScience spellings as aliases)
and the parsed flags -> GPTConfig mapping. Without these flags the model is GPT-2.

LLaMA:  --normalization rmsnorm --swiglu --position-embedding-type rope --num-key-value-heads N
        --untie-embeddings-and-output-weights --disable-bias-linear
BLOOM:  --position-embedding-type alibi --embed-layernorm
Qwen3:  LLaMA's + --qk-layernorm (+ --kv-channels D where the head size is not hidden / heads, as Qwen3-32B's
        and Qwen3-30B-A3B's 128); Mixtral: LLaMA's + --num-experts N (moe_args.py); Qwen3-MoE: Qwen3's + experts
Long contexts: LLaMA 3.1's --use-rope-scaling, YaRN, linear (rope_args.py)

The flag checks here resolve the aliases (and refuse two that disagree); the model's rules (head counts,
head size, RoPE) live in GPTConfig alone (torch-free, megatron_ds/gpt_config.config_problem), which
checks them when parse_args builds the run's one config (run_gpt_config).
"""
import dataclasses

from megatron_ds.gpt_config import NORMALIZATIONS, POSITION_EMBEDDINGS, GPTConfig

from .document_args import FLAGS as DOCUMENT_FLAGS
from ..errors import ArgumentsError
from .moe_args import moe_config_from_args, moe_flags
from .rope_args import add_rope_args, rope_scaling_flags, rope_scaling_from_flags

# the GPTConfig fields these flags set (a checkpoint loads only into a run with the same values)
MODEL_FAMILY_ARGS = ("normalization", "swiglu", "position_embedding_type", "rope_theta", "num_key_value_heads",
                     "untie_embeddings_and_output_weights", "add_bias_linear", "embed_layernorm", "qk_layernorm",
                     "kv_channels", "rope_scaling")
_POSITION_ALIASES = {"absolute": "learned_absolute", "rotary": "rope"}  # BigScience's names
_YARN = "yarn"  # Megatron-core's position type: rope with YaRN's scaling (rope_args.py)


def _position_type(text):
    text = text.lower()
    return _POSITION_ALIASES.get(text, text)


def add_model_args(parser):
    g = parser.add_argument_group("model family")
    g.add_argument("--normalization", type=str.lower, choices=NORMALIZATIONS, default="layernorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (LLaMA); see --ffn-hidden-size")
    g.add_argument("--glu-activation", choices=["swiglu"], default=None, help="BigScience's spelling of --swiglu")
    g.add_argument("--position-embedding-type", type=_position_type, choices=POSITION_EMBEDDINGS + (_YARN,),
                   default=None, help="default learned_absolute (BigScience's absolute/rotary/alibi are accepted "
                                      "too; Megatron-core's yarn is rope with --rope-scaling-type yarn)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="same as --position-embedding-type rope")
    g.add_argument("--rope-theta", "--rotary-base", type=float, default=10000.0,
                   help="RoPE's base (Megatron-LM's --rotary-base)")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="grouped-query attention: K/V heads, each shared by heads / N query heads")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="the head size where it is not --hidden-size / --num-attention-heads (Megatron's flag; "
                        "Hugging Face's head_dim): the queries are heads x this wide, the K/V heads as wide")
    g.add_argument("--group-query-attention", action="store_true", help="Megatron-LM: with --num-query-groups")
    g.add_argument("--num-query-groups", type=int, default=None, help="Megatron-LM's --num-key-value-heads")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="the LM head has its own weight (its own pipeline layer)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the attention and MLP linear layers")
    g.add_argument("--embed-layernorm", action="store_true", help="a norm after the word embeddings (BLOOM)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each query and key head (over the head size) before RoPE (Qwen3)")
    add_rope_args(g)


def validate_model_args(args):
    """Resolve the aliases into one value each; refuse impossible combinations (ArgumentsError)."""
    args.swiglu = args.swiglu or args.glu_activation == "swiglu"
    position_flag = args.position_embedding_type
    if position_flag == _YARN:
        args.position_embedding_type = "rope"
    args.rope_scaling = rope_scaling_from_flags(args, position_flag)
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in (None, "rope"):
            raise ArgumentsError(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                                 f"{args.position_embedding_type}: give one of them")
        args.position_embedding_type = "rope"
    args.position_embedding_type = args.position_embedding_type or "learned_absolute"
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentsError("--num-query-groups needs --group-query-attention (or use --num-key-value-heads)")
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise ArgumentsError("--group-query-attention needs --num-query-groups N")
        if args.num_key_value_heads not in (None, args.num_query_groups):
            raise ArgumentsError(f"--num-query-groups {args.num_query_groups} disagrees with --num-key-value-heads "
                                 f"{args.num_key_value_heads}: give one of them")
        args.num_key_value_heads = args.num_query_groups
    if args.num_key_value_heads is not None and args.num_key_value_heads < 1:
        raise ArgumentsError(f"--num-key-value-heads must be positive, got {args.num_key_value_heads}")
    args.num_key_value_heads = args.num_key_value_heads or args.num_attention_heads
    if args.kv_channels is not None and args.kv_channels * args.num_attention_heads == args.hidden_size:
        args.kv_channels = None  # the default head size: saved and compared as the flag left out (GPTConfig's)


def check_liger():
    """--use-liger-kernel needs the package and a CUDA device (its kernels are Triton's)."""
    import importlib.util
    if importlib.util.find_spec("liger_kernel") is None:
        raise ArgumentsError("--use-liger-kernel: liger_kernel is not importable (pip install liger-kernel)")
    import torch
    if not torch.cuda.is_available():
        raise ArgumentsError("--use-liger-kernel: Liger's kernels are Triton's, for CUDA devices; this machine "
                             "has none (--loss-chunk-size is the same fused head and loss in torch)")


def run_gpt_config(args):
    """The run's GPTConfig, built once at parse time, with the tensor- and context-parallel split it runs under. The
    vocabulary is --pad-vocab-size-to's, else None until the tokenizer pads it (model_setup.model_config)."""
    try:
        return dataclasses.replace(gpt_config_from_args(args), vocab_size=args.pad_vocab_size_to,
                                   tensor_model_parallel_size=args.tensor_model_parallel_size,
                                   sequence_parallel=args.sequence_parallel, moe=moe_config_from_args(args),
                                   context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
                                   hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes)
    except ValueError as exc:  # GPTConfig's own rules (and ParallelConfigError: the split over TP ranks)
        raise ArgumentsError(str(exc)) from None


def gpt_config_from_args(args):
    """The model the flags describe (one process: no tensor- or expert-parallel split), with the padded
    vocabulary of a checkpoint's saved args (None before the tokenizer). Flags saved args predate take
    their defaults."""
    family = {name: getattr(args, name) for name in MODEL_FAMILY_ARGS if getattr(args, name, None) is not None}
    return GPTConfig(vocab_size=getattr(args, "padded_vocab_size", None), hidden_size=args.hidden_size,
                     num_layers=args.num_layers,
                     num_attention_heads=args.num_attention_heads,
                     max_position_embeddings=args.max_position_embeddings,
                     ffn_hidden_size=args.ffn_hidden_size or 0, hidden_dropout=args.hidden_dropout,
                     attention_dropout=args.attention_dropout, layernorm_epsilon=args.layernorm_epsilon,
                     init_method_std=args.init_method_std, seed=args.seed,
                     loss_chunk_size=getattr(args, "loss_chunk_size", 0) or 0,
                     liger_kernel=getattr(args, "use_liger_kernel", False), moe=_one_process(moe_config_from_args(args)),
                     **documents_from_args(args), **family)


def documents_from_args(args):
    """The packed-document options (document_args.py): the three flags, and the end-of-document token once the
    tokenizer gave it (a checkpoint's saved args carry it)."""
    flags = {name: bool(getattr(args, name, False)) for name in DOCUMENT_FLAGS}
    return dict(flags, eod_token=getattr(args, "eod_token", None))


def _one_process(moe):
    """A MoEConfig with every expert on one process (offline tools read an expert-parallel run's checkpoint so)."""
    return moe if moe is None else dataclasses.replace(moe, expert_model_parallel_size=1)


def model_family_flags(config) -> list:
    """The flags that give a GPTConfig's family options (none for GPT-2), its experts' included: the inverse
    of the above."""
    flags = []
    if config.normalization != "layernorm":
        flags += ["--normalization", config.normalization]
    if config.swiglu:
        flags.append("--swiglu")
    if config.position_embedding_type != "learned_absolute":
        flags += ["--position-embedding-type", config.position_embedding_type]
    if config.position_embedding_type == "rope":
        flags += ["--rope-theta", repr(float(config.rope_theta))]
    if config.num_key_value_heads != config.num_attention_heads:
        flags += ["--num-key-value-heads", str(config.num_key_value_heads)]
    if config.kv_channels is not None:
        flags += ["--kv-channels", str(config.kv_channels)]
    flags += rope_scaling_flags(config.rope_scaling)
    for name, on in (("--untie-embeddings-and-output-weights", config.untie_embeddings_and_output_weights),
                     ("--disable-bias-linear", not config.add_bias_linear),
                     ("--embed-layernorm", config.embed_layernorm), ("--qk-layernorm", config.qk_layernorm)):
        if on:
            flags.append(name)
    return flags + moe_flags(config.moe)
