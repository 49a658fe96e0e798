"""Mixture-of-experts options, named as Megatron-core's flags (torch-free: the flags build it at parse time).

A GPT whose GPTConfig has `moe` set replaces the MLP of the layers `moe_layer_freq` picks by a router and
`num_experts` expert MLPs (plus, optionally, one shared expert every token passes through). Defaults are
Megatron-core's: top-2, softmax scores, the auxiliary load-balancing loss, dropless.
"""
import ast
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    router_topk: int = 2
    ffn_hidden_size: int = 0  # 0: the dense MLP's ffn_hidden_size (Megatron's --moe-ffn-hidden-size default)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    layer_freq: Tuple[int, ...] = (1,)  # one entry per layer (1: MoE, 0: dense), or (N,): every N-th layer
    score_function: str = "softmax"
    pre_softmax: bool = False  # softmax over all experts before the top-k (else over the top-k logits only)
    topk_scaling_factor: Optional[float] = None
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    enable_expert_bias: bool = False  # DeepSeek-V3: a per-expert routing bias updated from the batch's counts
    bias_update_rate: float = 1e-3
    num_groups: int = 0  # group-limited routing: experts in this many groups,
    group_topk: int = 0  # of which each token may use this many
    capacity_factor: Optional[float] = None  # None: dropless
    expert_model_parallel_size: int = 1
    grouped_gemm: bool = False

    def is_moe_layer(self, index: int, num_layers: int) -> bool:
        """Whether transformer layer `index` (0-based among the L transformer layers) has experts."""
        return bool(layer_pattern(self.layer_freq, num_layers)[index])


def layer_pattern(layer_freq, num_layers):
    """Megatron's --moe-layer-freq as one 0/1 per layer: an int N puts experts in layers 0, N, 2N, ...;
    a list gives each layer's entry."""
    if len(layer_freq) == 1 and num_layers != 1:
        return [int(i % layer_freq[0] == 0) for i in range(num_layers)]
    return list(layer_freq)


def parse_layer_freq(text):
    """--moe-layer-freq: an int, or a list of 0/1 as Megatron writes it ("[0,1,1]" or "([0]*1+[1]*3)"), or bare
    ("0,1,1": what the checkpoint tools write, no quoting needed in a shell)."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        return (int(text),)
    try:
        value = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise ValueError(f"--moe-layer-freq {text!r}: give an int N (every N-th layer) or a list of 0/1 per "
                         f"layer such as [0,1,1,1], ([0]*1+[1]*3) or 0,1,1,1") from None
    return tuple(value)


def _eval_pattern(node):
    """A list expression of 0/1 literals, '+' and '* int' (no names, no calls: nothing runs)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_pattern(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(ast.dump(node))


def moe_problem(m: MoEConfig, num_layers: int, tensor_parallel: int = 1) -> str:
    """What makes these MoE options impossible (named by flag), or '' when they work."""
    e, k = m.num_experts, m.router_topk
    if e < 1:
        return f"--num-experts must be at least 1, got {e}"
    if not 1 <= k <= e:
        return f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e})"
    if m.score_function not in SCORE_FUNCTIONS:
        return f"--moe-router-score-function {m.score_function!r}: choose one of {', '.join(SCORE_FUNCTIONS)}"
    if m.load_balancing_type not in LOAD_BALANCING_TYPES:
        return (f"--moe-router-load-balancing-type {m.load_balancing_type!r}: choose one of "
                f"{', '.join(LOAD_BALANCING_TYPES)}")
    if m.pre_softmax and m.score_function != "softmax":
        return "--moe-router-pre-softmax applies to --moe-router-score-function softmax only"
    if m.num_groups or m.group_topk:
        if not (m.num_groups and m.group_topk):
            return "--moe-router-num-groups and --moe-router-group-topk go together: give both"
        if e % m.num_groups:
            return f"--moe-router-num-groups ({m.num_groups}) must divide --num-experts ({e})"
        if not 1 <= m.group_topk <= m.num_groups:
            return f"--moe-router-group-topk ({m.group_topk}) must be between 1 and --moe-router-num-groups ({m.num_groups})"
        if k % m.group_topk or k > m.group_topk * (e // m.num_groups):
            return (f"--moe-router-topk ({k}) must be a multiple of --moe-router-group-topk ({m.group_topk}) and fit "
                    f"in the chosen groups ({m.group_topk} x {e // m.num_groups} experts)")
    if m.capacity_factor is not None and not m.capacity_factor > 0:
        return f"--moe-expert-capacity-factor must be positive (leave it out for dropless), got {m.capacity_factor}"
    if m.enable_expert_bias and m.score_function != "sigmoid":
        return "--moe-router-enable-expert-bias steers sigmoid scores (DeepSeek-V3): add --moe-router-score-function sigmoid"
    if m.enable_expert_bias and not m.bias_update_rate > 0:
        return f"--moe-router-bias-update-rate must be positive, got {m.bias_update_rate}"
    if m.aux_loss_coeff < 0 or m.z_loss_coeff < 0:
        return "--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0"
    if m.ffn_hidden_size < 0 or m.shared_expert_intermediate_size < 0:
        return "--moe-ffn-hidden-size and --moe-shared-expert-intermediate-size must be >= 0"
    ep = m.expert_model_parallel_size
    if ep < 1 or e % ep:
        return f"--expert-model-parallel-size ({ep}) must divide --num-experts ({e}): each rank holds whole experts"
    pattern = m.layer_freq
    if len(pattern) == 1 and num_layers != 1:
        if pattern[0] < 1:
            return f"--moe-layer-freq must be a positive int or a list, got {pattern[0]}"
    elif len(pattern) != num_layers or set(pattern) - {0, 1}:
        return f"--moe-layer-freq: a list needs one 0 or 1 per layer ({num_layers}), got {list(pattern)}"
    if not any(layer_pattern(pattern, num_layers)):
        return "--moe-layer-freq leaves no layer with experts"
    if m.shared_expert_intermediate_size % tensor_parallel:  # the shared expert splits as the dense MLP does
        return (f"--moe-shared-expert-intermediate-size ({m.shared_expert_intermediate_size}) must be divisible by "
                f"--tensor-model-parallel-size ({tensor_parallel})")
    return ""


def expert_parallel_problem(ep: int, data_parallel: int, context_parallel: int = 1) -> str:
    """'' when EP groups can be made of each stage's (and TP rank's) data-parallel ranks (under context
    parallelism its data x context-parallel ranks: the topology's data axis), else why not."""
    lanes = data_parallel * context_parallel
    if lanes % ep:
        size = (f"the data-parallel size {data_parallel}" if context_parallel == 1 else
                f"the data-parallel x context-parallel size {data_parallel} x {context_parallel} = {lanes}")
        return (f"--expert-model-parallel-size {ep} must divide {size}: an expert-parallel group is made of "
                "data-parallel" + (" and context-parallel" if context_parallel > 1 else "") +
                " ranks of one pipeline stage and tensor-parallel rank")
    return ""


def compact_layer_freq(pattern) -> Tuple[int, ...]:
    """One 0/1 per layer as --moe-layer-freq writes it shortest: (N,) when it is every N-th layer from the first."""
    pattern = [int(bool(p)) for p in pattern]
    for n in range(1, len(pattern) + 1):
        if layer_pattern((n,), len(pattern)) == pattern:
            return (n,)
    return tuple(pattern)


def hf_moe_family(m: MoEConfig, num_layers: int, qk_layernorm: bool) -> Tuple[Optional[str], str]:
    """The Hugging Face family of these MoE options on LLaMA's layout without biases: ("mixtral", ""),
    ("qwen3_moe", "") with per-head query/key norms, or (None, the option neither has, named by flag).
    Options that act in training only (the balancing and z losses, the expert-parallel split) do not count."""
    unmapped = (("--moe-router-score-function sigmoid", m.score_function != "softmax"),
                ("--moe-router-enable-expert-bias", m.enable_expert_bias),
                ("--moe-router-num-groups", bool(m.num_groups)),
                ("--moe-router-topk-scaling-factor", m.topk_scaling_factor not in (None, 1.0)),
                ("--moe-expert-capacity-factor", m.capacity_factor is not None),
                ("--moe-shared-expert-intermediate-size (a shared expert)", bool(m.shared_expert_intermediate_size)))
    for flag, on in unmapped:
        if on:
            return None, f"{flag}: Mixtral and Qwen3-MoE have no such option"
    if qk_layernorm:
        return "qwen3_moe", ""
    if m.pre_softmax:
        return None, ("--moe-router-pre-softmax without --qk-layernorm: Mixtral renormalises the top-k probabilities "
                      "(Qwen3-MoE, which has --qk-layernorm, does either)")
    if not all(layer_pattern(m.layer_freq, num_layers)):
        return None, ("--moe-layer-freq: Mixtral has experts in every layer (Qwen3-MoE, which has --qk-layernorm, "
                      "may leave layers dense)")
    return "mixtral", ""


def with_ffn_default(m: MoEConfig, ffn_hidden_size: int) -> MoEConfig:
    """The experts' FFN size resolved: Megatron's default is the dense MLP's."""
    return m if m.ffn_hidden_size else dataclasses.replace(m, ffn_hidden_size=ffn_hidden_size)
