"""Seq1F1B's segments of a sequence and sequence parallelism's shards of it (pure data, no torch): the cut
the plan runs (pipe/plan.py) and the cuts "auto" weighs (pipe/auto_start.py) come of the same rules here."""
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
                                        SEGMENT_MULTIPLE, **flop_shape(config), keys=keys)
    except ScheduleError as exc:
        raise ConfigError(f"{where}: {exc}; use fewer segments, a longer sequence or \"even\"") from None


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
