"""RoPE scaling for long contexts, as transformers (modeling_rope_utils) and Megatron-core define it (torch-free:
the flags build it at parse time; model/positions.inverse_frequencies turns it into the rotation's frequencies).

- linear: every inverse frequency divided by `factor` (positions interpolated; Megatron's
  --rotary-seq-len-interpolation-factor).
- llama3: LLaMA 3.1's. Of the wavelengths 2 pi / inv_freq, those longer than original / low_freq_factor are
  divided by `factor`, those shorter than original / high_freq_factor kept, those between blended smoothly
  (original = original_max_position_embeddings, the context the model was pretrained at). Megatron's
  --use-rope-scaling, whose other constants are 1, 4 and 8192.
- yarn: YaRN (Qwen's long-context configs). The dimensions that turn fewer than beta_slow times over the original
  context are interpolated (divided by `factor`), those that turn more than beta_fast times kept, a linear ramp
  between them; and cos and sin are multiplied by the attention factor (0.1 ln(factor) + 1 unless given, or the
  ratio of mscale's to mscale_all_dim's), so that the attention logits scale by its square.

A RopeScaling is frozen and hashable (the cos/sin tables are cached by it). Its dict form is Hugging Face's
`rope_parameters` without rope_theta: what the run's saved args, the import and the export carry. A key left out
is None here and takes transformers' default where it is used (yarn's beta_fast 32, beta_slow 1).
"""
import math
from dataclasses import dataclass, fields
from typing import Optional

TYPES = ("llama3", "linear", "yarn")
# each key's flag (training/config/rope_args.py), for the messages
FLAGS = {"rope_type": "--rope-scaling-type", "factor": "--rope-scaling-factor",
         "original_max_position_embeddings": "--rope-scaling-original-max-position-embeddings",
         "low_freq_factor": "--rope-scaling-low-freq-factor", "high_freq_factor": "--rope-scaling-high-freq-factor",
         "beta_fast": "--yarn-beta-fast", "beta_slow": "--yarn-beta-slow", "mscale": "--yarn-mscale",
         "mscale_all_dim": "--yarn-mscale-all-dim", "attention_factor": "--yarn-attention-factor"}
REQUIRED = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}
OPTIONAL = {"linear": (), "llama3": (),
            "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")}
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # transformers' (and the YaRN paper's) defaults


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str
    factor: float
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None

    @classmethod
    def from_dict(cls, d: dict) -> "RopeScaling":
        """Hugging Face's rope_parameters (rope_theta and a whole partial_rotary_factor of 1 set aside; "type"
        is its old name of rope_type). ValueError, one line, for a type or key our layers lack."""
        d = dict(d)
        old = d.pop("type", None)
        kind = d.pop("rope_type", None) or old
        d.pop("rope_theta", None)
        partial = d.pop("partial_rotary_factor", None)
        if partial not in (None, 1, 1.0):
            raise ValueError(f"RoPE partial_rotary_factor {partial}: ours rotates every channel of a head")
        if d.pop("truncate", True) is not True:
            raise ValueError("RoPE scaling yarn with truncate false: ours rounds the correction range to whole "
                             "dimensions (transformers' default)")
        if kind not in TYPES:
            raise ValueError(f"RoPE scaling type {kind!r}: ours are {', '.join(TYPES)} ({FLAGS['rope_type']})")
        missing = [k for k in REQUIRED[kind] if d.get(k) is None]
        if missing:
            raise ValueError(f"RoPE scaling {kind} needs {', '.join(f'{k} ({FLAGS[k]})' for k in missing)}")
        extra = sorted(k for k in d if k not in REQUIRED[kind] + OPTIONAL[kind] and d[k] is not None)
        if extra:
            takes = ", ".join(REQUIRED[kind] + OPTIONAL[kind])
            raise ValueError(f"RoPE scaling {kind} takes no {', '.join(extra)} (it takes {takes})")
        values = {k: d.get(k) for k in REQUIRED[kind] + OPTIONAL[kind]}
        bad = [k for k, v in values.items() if v is not None and not _number(v)]
        if bad:
            key = bad[0]
            raise ValueError(f"RoPE scaling {kind}: {key} ({FLAGS[key]}) must be a number, got {values[key]!r}")
        return cls(rope_type=kind, **{k: _plain(k, v) for k, v in values.items()})

    def as_dict(self) -> dict:
        """Hugging Face's rope_parameters of this scaling (without rope_theta), the keys left out left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def attention_scale(self) -> float:
        """What cos and sin are multiplied by (transformers' attention_factor; 1 but for yarn)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    def yarn_correction_range(self, head_dim: int, theta: float):
        """(low, high): the dimensions (of head_dim / 2 pairs) between which YaRN's ramp runs from kept
        (turning more than beta_fast times over the original context) to interpolated (fewer than beta_slow)."""
        fast = self.beta_fast or YARN_BETA_FAST
        slow = self.beta_slow or YARN_BETA_SLOW

        def dim_of(turns):  # the dimension whose wavelength fits `turns` times into the original context
            return head_dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (
                2 * math.log(theta))
        return max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), head_dim - 1)


def yarn_mscale(factor, mscale=1.0):
    """YaRN's attention temperature for a context `factor` times longer: 0.1 mscale ln(factor) + 1 (1 for <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(key, value):
    """Ints stay ints where HF has them (the original context), the rest floats (hash and compare alike)."""
    if value is None:
        return None
    return int(value) if key == "original_max_position_embeddings" and float(value).is_integer() else float(value)


def rope_scaling_problem(scaling) -> str:
    """What makes this scaling (a RopeScaling or its dict) impossible, named by flag, or '' when it works."""
    if scaling is None:
        return ""
    if isinstance(scaling, dict):
        try:
            scaling = RopeScaling.from_dict(scaling)
        except ValueError as exc:
            return str(exc)
    s = scaling
    finite = [k for k in REQUIRED[s.rope_type] + OPTIONAL[s.rope_type]
              if getattr(s, k) is not None and not math.isfinite(getattr(s, k))]
    if finite:
        return f"{FLAGS[finite[0]]} must be a finite number, got {getattr(s, finite[0])}"
    if not s.factor >= 1:
        return (f"{FLAGS['factor']} must be at least 1 (the context is that many times the original), "
                f"got {s.factor}")
    original = s.original_max_position_embeddings
    if original is not None and (not isinstance(original, int) or original < 1):
        return f"{FLAGS['original_max_position_embeddings']} must be a positive whole number, got {original}"
    if s.rope_type == "llama3" and not 0 < s.low_freq_factor < s.high_freq_factor:
        return (f"{FLAGS['low_freq_factor']} ({s.low_freq_factor}) and {FLAGS['high_freq_factor']} "
                f"({s.high_freq_factor}): LLaMA 3.1's scaling needs 0 < low < high")
    if s.rope_type == "yarn":
        fast, slow = s.beta_fast or YARN_BETA_FAST, s.beta_slow or YARN_BETA_SLOW
        if not 0 < slow <= fast:
            return (f"{FLAGS['beta_fast']} ({fast}) and {FLAGS['beta_slow']} ({slow}): YaRN needs "
                    "0 < beta_slow <= beta_fast (rotations over the original context)")
        if s.attention_factor is not None and not s.attention_factor > 0:
            return f"{FLAGS['attention_factor']} must be positive, got {s.attention_factor}"
    return ""
