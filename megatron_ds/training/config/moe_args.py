"""Mixture-of-experts flags, Megatron-core's names (Megatron-DeepSpeed's as aliases where they mean the
same), and the parsed flags -> MoEConfig. Without --num-experts the model is dense.

The checks that need no process group run here, at parse time (exit 2): a MoE flag without
--num-experts, and MoEConfig's own rules (moe_config.moe_problem) named by flag. The same settings may sit in
the ds_config's "moe" section, keyed by the flags' names with underscores (moe_ds_config).
"""
import dataclasses

from megatron_ds.moe_config import (LOAD_BALANCING_TYPES, SCORE_FUNCTIONS, MoEConfig, expert_parallel_problem, moe_problem,
                                    parse_layer_freq)
from ..errors import ArgumentsError
from .ds_sections import flag_section

# flag dest -> MoEConfig field (the flags' defaults are None: given or not is known)
_FIELDS = {"moe_router_topk": "router_topk", "moe_ffn_hidden_size": "ffn_hidden_size",
           "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
           "moe_router_score_function": "score_function", "moe_router_pre_softmax": "pre_softmax",
           "moe_router_topk_scaling_factor": "topk_scaling_factor",
           "moe_router_load_balancing_type": "load_balancing_type", "moe_aux_loss_coeff": "aux_loss_coeff",
           "moe_z_loss_coeff": "z_loss_coeff", "moe_router_enable_expert_bias": "enable_expert_bias",
           "moe_router_bias_update_rate": "bias_update_rate", "moe_router_num_groups": "num_groups",
           "moe_router_group_topk": "group_topk", "moe_expert_capacity_factor": "capacity_factor",
           "expert_model_parallel_size": "expert_model_parallel_size", "moe_grouped_gemm": "grouped_gemm"}


def add_moe_args(parser):
    g = parser.add_argument_group("mixture of experts (Megatron-core's flags)")
    g.add_argument("--num-experts", type=int, nargs="+", default=None, metavar="N",
                   help="routed experts per MoE layer (Megatron-DeepSpeed's list form takes one value here)")
    g.add_argument("--moe-router-topk", "--topk", type=int, default=None, help="experts per token (default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert every token passes through, of this FFN size")
    g.add_argument("--moe-layer-freq", type=str, default=None,
                   help="N: experts in every N-th layer from the first; or one 0/1 per layer: [0,1,1,1], "
                        "([0]*1+[1]*3) or 0,1,1,1")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default=None)
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts before the top-k (Qwen3's norm_topk_prob=False)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default=None)
    g.add_argument("--moe-aux-loss-coeff", "--moe-loss-coeff", type=float, default=None)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="DeepSeek-V3's balancing without an auxiliary loss (sigmoid scores)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="group-limited routing: the groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups per token")
    g.add_argument("--moe-expert-capacity-factor", "--moe-train-capacity-factor", type=float, default=None,
                   help="tokens over an expert's capacity are dropped (default: dropless)")
    g.add_argument("--expert-model-parallel-size", "--moe-expert-parallel-size", type=int, default=None)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None)


DS_SECTION = "moe"  # ds_config {"moe": {<a MoE flag's dest>: value, ...}}: the flags, where the run's settings live


def moe_ds_config(args, ds_config, src) -> dict:
    """The ds_config's "moe" section as flag values ({flag dest: value}; {} without one): each key is a MoE flag's
    name with underscores ("num_experts", "moe_router_topk", "expert_model_parallel_size", ...), and a flag given
    too must agree (ArgumentsError, exit 2, before anything starts; ds_sections.py). The parse keeps it as
    args.moe_ds_config, which `setting` reads beside the flags."""
    return flag_section(args, ds_config, DS_SECTION, add_moe_args, src, "MoE", _layer_freq_value, _same)


def _layer_freq_value(action, value):
    """--moe-layer-freq's ds_config value (an int, a list or the flag's text), read as the flag's text."""
    if action.dest != "moe_layer_freq":
        return None
    return str(value), isinstance(value, (int, list, str)) and not isinstance(value, bool)


def _same(dest, given, value):
    return parse_layer_freq(given) == parse_layer_freq(value) if dest == "moe_layer_freq" else given == value


def setting(args, dest):
    """A MoE flag's value: given as a flag, or in the ds_config's "moe" section (None: neither)."""
    value = getattr(args, dest, None)
    return value if value is not None else (getattr(args, "moe_ds_config", None) or {}).get(dest)


def moe_config_from_args(args):
    """The MoEConfig the flags give, None for a dense model (also for saved args that predate MoE)."""
    experts = setting(args, "num_experts")
    if not experts:
        return None
    options = {field: setting(args, dest) for dest, field in _FIELDS.items() if setting(args, dest) is not None}
    if setting(args, "moe_layer_freq") is not None:
        options["layer_freq"] = parse_layer_freq(setting(args, "moe_layer_freq"))
    return MoEConfig(num_experts=experts[0] if isinstance(experts, list) else experts, **options)


def moe_flags(m) -> list:
    """The flags that give MoEConfig `m` (none for a dense model): the inverse of moe_config_from_args. The
    experts' count, top-k and FFN size always, the other options where they differ from the defaults."""
    if m is None:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    flags = ["--num-experts", str(m.num_experts)]
    for dest, field in _FIELDS.items():
        value = getattr(m, field)
        if value == defaults[field] and field not in ("router_topk", "ffn_hidden_size"):
            continue
        flag = "--" + dest.replace("_", "-")
        flags += [flag] if isinstance(value, bool) else [flag, repr(value) if isinstance(value, float) else str(value)]
    if m.layer_freq != defaults["layer_freq"]:
        pattern = m.layer_freq
        flags += ["--moe-layer-freq", ",".join(map(str, pattern))]  # "N", or "0,1,1,1": no shell quoting
    return flags


def validate_moe_args(args):
    """Refuse what no MoE run can do, naming the flag (ArgumentsError, exit 2)."""
    given = sorted("--" + dest.replace("_", "-") for dest in [*_FIELDS, "moe_layer_freq", "expert_tensor_parallel_size"]
                   if setting(args, dest) is not None)
    experts = setting(args, "num_experts")
    if not experts:
        if given:
            raise ArgumentsError(f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} experts: add "
                                 f"--num-experts N (without it the model is dense)")
        return
    if len(experts) > 1:
        raise ArgumentsError(f"--num-experts {' '.join(map(str, experts))}: give one count (every MoE layer "
                             f"has the same experts; --moe-layer-freq picks the layers)")
    if (setting(args, "expert_tensor_parallel_size") or 1) > 1:
        raise ArgumentsError("--expert-tensor-parallel-size > 1: experts are not split over tensor-parallel ranks "
                             "(tensor parallelism splits attention and the dense MLPs; experts stay whole)")
    try:
        config = moe_config_from_args(args)
    except ValueError as exc:  # --moe-layer-freq's text
        raise ArgumentsError(str(exc)) from None
    problem = moe_problem(config, args.num_layers, args.tensor_model_parallel_size)
    if problem:
        raise ArgumentsError(problem)


def check_expert_parallel_size(args):
    """With the data-parallel size derived (ArgumentsError, exit 2, before any process group starts). The experts
    are shared out over the topology's data axis, which holds the context-parallel ranks too (DP x CP)."""
    moe = args.gpt_config.moe
    cp = getattr(args, "context_parallel_size", 1)
    problem = expert_parallel_problem(moe.expert_model_parallel_size, args.data_parallel_size, cp) if moe else ""
    if problem:
        raise ArgumentsError(problem)
