"""The rules a schedule puts on the model's shape: layers per virtual stage, tokens per Seq1F1B segment.

Pure Python (no torch, no DeepSpeed): parse_args checks them before any rank starts, and the model build
uses the same functions.
"""
from megatron_ds.schedules import ScheduleError
from megatron_ds.schedules.seq_split import balanced_segment_lengths, even_segment_lengths

from .config import ConfigError

SEGMENT_MULTIPLE = 8  # balanced Seq1F1B segment lengths are multiples of this (kernel-friendly)


def check_layers(schedule, num_layers: int):
    stages = schedule.stages
    if stages > schedule.pp and num_layers % stages:
        raise ConfigError(f"schedule {schedule.name!r} cuts the model into {stages} virtual stages: "
                          f"--num-layers {num_layers} must be a multiple of {stages}")
    if num_layers < stages:
        raise ConfigError(f"schedule {schedule.name!r} needs at least one transformer layer per virtual stage: "
                          f"--num-layers {num_layers} < {stages} stages")


def segment_lengths(settings, config, seq_length: int) -> list:
    """Token counts of the pipeline.seq_splits segments of a sequence (Seq1F1B); `config` gives
    hidden_size and ffn_hidden_size."""
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
                                        SEGMENT_MULTIPLE)
    except ScheduleError as exc:
        raise ConfigError(f"{where}: {exc}; use fewer segments, a longer sequence or \"even\"") from None
