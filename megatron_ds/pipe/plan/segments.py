"""Seq1F1B's segments of a sequence, and sequence and context parallelism's shards of it (pure data, no torch):
the cut the plan runs (pipe/plan/plan.py) and the cuts "auto" weighs (pipe/plan/auto_start.py) come of the same rules
here."""
import math

from megatron_ds.parallel_layout import context_unit, layout_problem, unit_name
from megatron_ds.schedules import ScheduleError
from megatron_ds.schedules.flops import layer_shape
from megatron_ds.schedules.seq_split import SEGMENT_MULTIPLE, balanced_segment_lengths, even_segment_lengths

from .config import ConfigError, PipelineSettings


def segment_lengths(settings: PipelineSettings, config, seq_length: int, keys=None) -> list:
    """Token counts of the pipeline.seq_splits segments of a sequence (Seq1F1B). `keys`: under a document mask
    the prefix sums of the keys a query sees on average (data/document_stats.py), which "balanced" weighs."""
    k, method = settings.seq_splits, settings.seq_split_method
    where = f'ds_config "pipeline.seq_splits" = {k} with "seq_split_method": "{method}"'
    if k > seq_length:
        raise ConfigError(f"{where}: more segments than the {seq_length} tokens of a sequence (--seq-length); "
                          "every segment needs at least one token")
    if method == "even":
        if seq_length % k:
            raise ConfigError(f"{where}: --seq-length {seq_length} must be a multiple of seq_splits "
                              '(or use "balanced")')
        return even_segment_lengths(seq_length, k)
    try:
        return balanced_segment_lengths(seq_length, k, config.hidden_size, config.ffn_hidden_size,
                                        segment_multiple(config), **flop_shape(config), keys=keys)
    except ScheduleError as exc:
        raise ConfigError(f"{where}: {exc}; use fewer segments, a longer sequence or \"even\"") from None


def segment_multiple(config) -> int:
    """What every balanced segment length is a multiple of: SEGMENT_MULTIPLE, and under context parallelism
    2 x CP (x TP with --sequence-parallel; context_shards). The layout is load-balanced, so a segment's
    attention FLOPs split evenly over the CP ranks: the cut weighs the same costs as without CP."""
    cp = getattr(config, "context_parallel_size", 1)
    unit = context_unit(cp, getattr(config, "tensor_model_parallel_size", 1), getattr(config, "sequence_parallel", False))
    return math.lcm(SEGMENT_MULTIPLE, unit) if cp > 1 else SEGMENT_MULTIPLE


def flop_shape(config) -> dict:
    """The layer's shape beyond h and f that its FLOPs depend on (schedules/flops.py)."""
    shape = layer_shape(config)
    return dict(heads=shape["heads"], kv_heads=shape["kv_heads"], swiglu=shape["swiglu"], head_dim=shape["head_dim"])


def sequence_shards(tp: int, sequence_parallel: bool, seq_length: int, lengths: list | None = None) -> int:
    """How many sequence shards the residual stream is cut into: TP under --sequence-parallel, else 1.
    Each shard must hold whole tokens: TP divides the sequence (and each Seq1F1B segment, which is split
    on its own: its tokens are what a segment's op holds)."""
    if not sequence_parallel or tp == 1:
        return 1
    if seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits each sequence over the {tp} tensor-parallel ranks: "
                          f"--seq-length {seq_length} must be a multiple of --tensor-model-parallel-size {tp}")
    uneven = [n for n in lengths or [] if n % tp]
    if uneven:
        raise ConfigError(f'--sequence-parallel splits each Seq1F1B segment over the {tp} tensor-parallel ranks: '
                          f'ds_config "pipeline.seq_splits" cuts --seq-length {seq_length} into {lengths}, and '
                          f'{uneven} are not multiples of --tensor-model-parallel-size {tp}')
    return tp


def context_shards(cp: int, tp: int, sequence_parallel: bool, seq_length: int, lengths: list | None = None) -> int:
    """How many context-parallel ranks share a sequence (CP). Each rank holds 2 of its 2 x CP equal chunks
    (model/context_parallel/layout.py), so 2 x CP divides the sequence and each Seq1F1B segment (cut on its own);
    under --sequence-parallel a rank's tokens are cut TP ways again: 2 x CP x TP divides them."""
    if cp == 1:
        return 1
    problem = layout_problem(seq_length, cp, "--seq-length", tp, sequence_parallel)
    if problem:
        raise ConfigError(problem)
    uneven = [n for n in lengths or [] if layout_problem(n, cp, "", tp, sequence_parallel)]
    if uneven:
        raise ConfigError(f'--context-parallel-size {cp} cuts each Seq1F1B segment into 2 x CP chunks: ds_config '
                          f'"pipeline.seq_splits" cuts --seq-length {seq_length} into {lengths}, and {uneven} are not '
                          f'multiples of {unit_name(cp, tp, sequence_parallel)} ({context_unit(cp, tp, sequence_parallel)}); '
                          'use "seq_split_method": "even" or fewer segments')
    return cp
