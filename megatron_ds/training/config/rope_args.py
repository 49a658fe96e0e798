"""RoPE scaling flags (megatron_ds/rope_scaling.py): Megatron's names where Megatron has the option, plain ones
where it has none, and the parsed flags -> the scaling's dict (args.rope_scaling, Hugging Face's rope_parameters
without rope_theta: saved with the run's args, compared on --load, read back by the checkpoint tools).

Megatron-LM: --use-rope-scaling is LLaMA 3.1's scaling with --rope-scaling-factor (default 8) and its constants
(low 1, high 4, original context 8192, each a flag here); --rotary-seq-len-interpolation-factor N is linear
scaling by N; --position-embedding-type yarn with --yarn-rotary-scaling-factor, --yarn-original-max-position-
embeddings, --yarn-beta-fast, --yarn-beta-slow, --yarn-mscale, --yarn-mscale-all-dim is YaRN. Ours besides:
--rope-scaling-type llama3|linear|yarn, which the others are spellings of, and --yarn-attention-factor
(transformers' attention_factor). A flag of one type given with another, or two spellings that disagree, is
one line and exit 2 at parse time, as is a value the scaling cannot take (rope_scaling_problem, through the
run's GPTConfig). The same settings may sit in the ds_config's "rope_scaling" section, keyed by the flags' names
with underscores, as the "moe" section holds the MoE flags (ds_sections.py).
"""
from megatron_ds.rope_scaling import FLAGS, OPTIONAL, REQUIRED, TYPES, RopeScaling

from ..errors import ArgumentsError
from .ds_sections import flag_section

DS_SECTION = "rope_scaling"  # ds_config {"rope_scaling": {<a RoPE scaling flag's dest>: value, ...}}

# flag dest -> the scaling's key (the dests are the flags' first names with underscores)
DESTS = {"rope_scaling_factor": "factor",
         "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings",
         "rope_scaling_low_freq_factor": "low_freq_factor", "rope_scaling_high_freq_factor": "high_freq_factor",
         "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale",
         "yarn_mscale_all_dim": "mscale_all_dim", "yarn_attention_factor": "attention_factor"}
# Megatron-core's LLaMA 3.1 scaling (apply_rope_scaling's defaults), what --use-rope-scaling alone means
MEGATRON_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def add_rope_args(group):
    """The flags, in the model-family group (--rope-theta's, whose Megatron-LM name --rotary-base is its alias)."""
    group.add_argument("--use-rope-scaling", action="store_true", default=None,
                       help="Megatron-LM: LLaMA 3.1's RoPE scaling (= --rope-scaling-type llama3)")
    group.add_argument("--rope-scaling-type", choices=TYPES, default=None,
                       help="long-context RoPE scaling as transformers' rope_type (docs/MODELS.md)")
    group.add_argument("--rope-scaling-factor", "--yarn-rotary-scaling-factor", type=float, default=None,
                       help="the context's length over the original's (llama3: default 8, Megatron's)")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                       help="Megatron-LM: linear scaling by this factor (= --rope-scaling-type linear "
                            "--rope-scaling-factor N)")
    group.add_argument("--rope-scaling-original-max-position-embeddings", "--yarn-original-max-position-embeddings",
                       type=int, default=None,
                       help="the context the model was pretrained at (llama3: default 8192, Megatron's; yarn: "
                            "required)")
    group.add_argument("--rope-scaling-low-freq-factor", type=float, default=None, help="llama3 (default 1)")
    group.add_argument("--rope-scaling-high-freq-factor", type=float, default=None, help="llama3 (default 4)")
    group.add_argument("--yarn-beta-fast", type=float, default=None, help="yarn (default 32)")
    group.add_argument("--yarn-beta-slow", type=float, default=None, help="yarn (default 1)")
    group.add_argument("--yarn-mscale", type=float, default=None,
                       help="yarn: with --yarn-mscale-all-dim, the attention factor is their mscales' ratio")
    group.add_argument("--yarn-mscale-all-dim", type=float, default=None, help="yarn (see --yarn-mscale)")
    group.add_argument("--yarn-attention-factor", type=float, default=None,
                       help="yarn: what cos and sin are multiplied by (default 0.1 ln(factor) + 1)")


def rope_ds_config(args, ds_config, src) -> dict:
    """The ds_config's "rope_scaling" section as flag values ({flag dest: value}; {} without one), a flag given
    too agreeing (ArgumentsError otherwise). The parse keeps it as args.rope_ds_config, read beside the flags."""
    return flag_section(args, ds_config, DS_SECTION, add_rope_args, src, "RoPE scaling")


def _setting(args, dest):
    """A RoPE scaling flag's value: given as a flag, or in the ds_config's section (None: neither)."""
    value = getattr(args, dest, None)
    return value if value is not None else (getattr(args, "rope_ds_config", None) or {}).get(dest)


def rope_scaling_from_flags(args, position_flag):
    """The scaling's dict the flags give (None: no scaling), its type's spellings resolved; ArgumentsError for two
    that disagree, a parameter of another type or one missing. `position_flag`: the --position-embedding-type
    given (Megatron-core's "yarn" is one of the spellings)."""
    kind, said = _setting(args, "rope_scaling_type"), "--rope-scaling-type"
    interpolation = _setting(args, "rotary_seq_len_interpolation_factor")
    spellings = [(_setting(args, "use_rope_scaling"), "llama3", "--use-rope-scaling"),
                 (position_flag == "yarn", "yarn", "--position-embedding-type yarn"),
                 (interpolation is not None, "linear", "--rotary-seq-len-interpolation-factor")]
    for given, their_kind, flag in spellings:
        if not given:
            continue
        if kind not in (None, their_kind):
            raise ArgumentsError(f"{flag} ({their_kind}) contradicts {said} ({kind}): give one of them")
        kind, said = their_kind, flag
    values = {key: _setting(args, dest) for dest, key in DESTS.items() if _setting(args, dest) is not None}
    if interpolation is not None:
        if values.get("factor", interpolation) != interpolation:
            raise ArgumentsError(f"--rotary-seq-len-interpolation-factor {interpolation} disagrees with "
                                 f"--rope-scaling-factor {values['factor']}: give one of them")
        values["factor"] = interpolation
    if kind is None:
        if values:
            named = ", ".join(FLAGS[key] for key in values)
            raise ArgumentsError(f"{named} scale{'s' if len(values) == 1 else ''} RoPE: add --rope-scaling-type "
                                 f"{'|'.join(TYPES)} (or --use-rope-scaling, LLaMA 3.1's)")
        return None
    foreign = [key for key in values if key not in REQUIRED[kind] + OPTIONAL[kind]]
    if foreign:
        takes = ", ".join(FLAGS[key] for key in REQUIRED[kind] + OPTIONAL[kind])
        raise ArgumentsError(f"{FLAGS[foreign[0]]} is no option of {kind} RoPE scaling ({said}), which takes {takes}")
    scaling = {"rope_type": kind, **(MEGATRON_LLAMA3 if kind == "llama3" else {}), **values}
    try:
        return RopeScaling.from_dict(scaling).as_dict()  # a required parameter missing: one line naming its flag
    except ValueError as exc:
        raise ArgumentsError(f"{str(exc)} ({said})") from None


def rope_scaling_flags(scaling) -> list:
    """The flags that give RopeScaling `scaling` (none for None): the inverse of rope_scaling_from_flags."""
    if scaling is None:
        return []
    flags = ["--rope-scaling-type", scaling.rope_type]
    for key, value in scaling.as_dict().items():
        if key != "rope_type":
            flags += [FLAGS[key], str(value) if isinstance(value, int) else repr(float(value))]
    return flags
