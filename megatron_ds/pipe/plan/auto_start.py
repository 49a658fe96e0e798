"""The start of `"schedule": "auto"` (pure data, no torch, at parse time): the budget in memory units, the
schedule the run starts and is timed on, the Seq1F1B cuts it weighs, and the AutoPlan the engine's timing and
decision (pipe/auto.py) take from there. pipe/plan/plan.make_plan calls start_auto for an "auto" section."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_ds.schedules import ScheduleError
from megatron_ds.schedules import auto, auto_recompute
from megatron_ds.schedules.flops import vocab_size
from megatron_ds.schedules.seq_split import segment_costs

from .config import ConfigError, PipelineSettings
from .partition import layer_flops
from .segments import context_shards, flop_shape, segment_lengths, sequence_shards


@dataclass(frozen=True)
class AutoPlan:
    """`"schedule": "auto"`: the budget in memory units (schedules/auto.py), the timed iterations
    [start, end) of this process, the model's layer count (which candidates it can be cut for), the
    Seq1F1B cuts of its sequence, and the schedule of other op sizes the window alternates with (a
    ds_config "pipeline" section; None: the start-up schedule only)."""
    budget: float
    timers: tuple
    num_layers: int
    budget_text: str
    cuts: tuple = ()
    probe: dict | None = None
    head_layers: float = 0.0  # the head + loss's forward FLOPs in transformer layers' (pipe/plan/partition.layer_flops)
    head_memory: float = 0.0  # a byte budget's: one micro-batch's logits in memory units (schedules/auto.logits_units)
    knobs: auto_recompute.Knobs | None = None  # "auto_recompute": the recompute settings weighed too
    recompute: dict | None = None  # then the setting the run starts (and is timed) under (auto_recompute.as_dict)


def seq1f1b_cuts(settings: PipelineSettings, config, seq: int, keys=None) -> tuple:
    """The run's sequence cut as the engine would cut it for Seq1F1B (the settings' seq_split_method),
    at each segment count of auto.SEQ_SPLITS the sequence allows (under --sequence-parallel: each
    segment a multiple of TP; under context parallelism of 2 x CP); `keys`: a document mask's (segment_lengths)."""
    tp, sp = getattr(config, "tensor_model_parallel_size", 1), getattr(config, "sequence_parallel", False)
    cp = getattr(config, "context_parallel_size", 1)
    cuts = []
    for k in auto.SEQ_SPLITS:
        try:
            lengths = segment_lengths(dataclasses.replace(settings, seq_splits=k), config, seq, keys)
            sequence_shards(tp, sp, seq, lengths)
            context_shards(cp, tp, sp, seq, lengths)
        except ConfigError:
            continue
        costs = segment_costs(lengths, config.hidden_size, getattr(config, "ffn_hidden_size", None), **flop_shape(config),
                              keys=keys)
        cuts.append(auto.Cut(k, tuple(lengths), tuple(costs)))
    return tuple(cuts)


def start_auto(settings: PipelineSettings, config, ds_config: dict, pp: int, mbs: int, gas: int, seq: int,
               keys=None):
    """(the settings of the schedule an "auto" run starts on, its AutoPlan); a budget no schedule
    fits is refused here, with the smallest one that would."""
    budget, text, unit, logits = settings.memory_budget, f"{settings.memory_budget}", None, 0.0
    cp = getattr(config, "context_parallel_size", 1)  # a rank's memory is of its seq / CP tokens
    if isinstance(budget, str):  # bytes: the logits count too (a chunked or fused loss holds none)
        dtype = 2 if any((ds_config.get(k) or {}).get("enabled") for k in ("bf16", "fp16")) else 4
        unit = auto.unit_bytes(config.num_layers / pp, seq, mbs, config.hidden_size,
                               getattr(config, "num_attention_heads", 1), dtype, cp)
        budget = auto.parse_bytes(budget) / unit
        if not getattr(config, "head_hands_weight", False):
            logits = auto.logits_units(seq, mbs, vocab_size(config), unit, cp)
        text = (f'"{settings.memory_budget}" = {budget:.4g} micro-batches of {unit:.0f} bytes, a micro-batch\'s '
                f'logits {logits:.3g} of them (estimates: schedules/auto.py)')
    cuts = seq1f1b_cuts(settings, config, seq, keys)
    space = dict(vocab_parallel=settings.vocab_parallel, head_memory=logits)
    knobs = recompute = None
    if settings.auto_recompute:
        if getattr(config, "moe", None) is not None:
            raise ConfigError('ds_config "pipeline.auto_recompute": true with a mixture of experts: the recompute '
                              "model (schedules/recompute.layer_memory) counts dense layers; give the recompute "
                              "flags yourself")
        dtype = 2 if any((ds_config.get(k) or {}).get("enabled") for k in ("bf16", "fp16")) else 4
        knobs = auto_recompute.Knobs.of(config, seq, mbs, dtype, pp, unit, cp, getattr(config, "cp_comm_type", "p2p"))
    try:
        if knobs:
            start, setting, probe = auto_recompute.start(budget, pp, gas, config.num_layers, knobs, cuts, **space)
            recompute = auto_recompute.as_dict(setting)
        else:
            start = auto.check_budget(budget, pp, gas, config.num_layers, cuts, **space)
            probe = auto.probe(start, budget, pp, gas, config.num_layers, cuts, **space)
    except ScheduleError as exc:
        in_bytes = f" (x {unit:.0f} bytes = {math.ceil(exc.smallest * unit)} bytes)" if unit else ""
        raise ConfigError(f'ds_config "pipeline.memory_budget" = {text}: {exc}{in_bytes}') from None
    concrete = dataclasses.replace(settings, schedule=start.schedule, **dict(start.knobs))
    flops = layer_flops(config)
    return concrete, AutoPlan(budget, (settings.timers_start_iter, settings.timers_end_iter), config.num_layers, text,
                              cuts, probe.section() if probe else None, flops[-1] / flops[1], space["head_memory"],
                              knobs, recompute)
