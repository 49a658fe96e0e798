"""The plan of one pipeline run (pure data, no torch): which schedule, where its chunks sit, the
micro-batch shape and the Seq1F1B segment lengths.

It is made once per run, at parse time (training/config/pipeline.check_schedule_shape; pipe/build.py
makes it only for callers without a parse), and the same object goes to ChunkedPipelineModule
(which cuts the layers by its placement) and to ScheduleEngine (which runs its op lists). It is
frozen: an "auto" switch is a new plan, placed alike, that the engine holds from then on. Every
setting that cannot work is refused here, as a ConfigError naming the key, the value and the rule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ds.parallel_layout import accumulation_steps, micro_batch_size
from megatron_ds.schedules import Schedule, ScheduleError
from megatron_ds.schedules.catalog import KNOBS
from megatron_ds.schedules.kinds import Kind

from .auto_start import AutoPlan, start_auto
from .config import ConfigError, PipelineSettings, pipeline_settings
from .messages import MessagePlan, lookahead, reads
from .partition import is_cost_method
from .segments import context_shards, segment_lengths, sequence_shards
from .vocab_messages import token_shards, width


def micro_batches_per_step(ds_config: dict, dp: int) -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) from the ds_config's batch keys."""
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    tbs = ds_config.get("train_batch_size")
    if mbs is None and tbs and gas:
        mbs = micro_batch_size(tbs, gas, dp)
    if gas is None and tbs and mbs:
        gas = accumulation_steps(tbs, mbs, dp)
    if (mbs is None or gas is None) and tbs and (mbs or gas):
        raise ConfigError(f"ds_config train_batch_size {tbs} is not a multiple of "
                          + (f"train_micro_batch_size_per_gpu {mbs}" if mbs else f"gradient_accumulation_steps {gas}")
                          + f" x the data-parallel size {dp}")
    if not mbs or not gas:
        raise ConfigError("ds_config needs two of train_batch_size, train_micro_batch_size_per_gpu and "
                          "gradient_accumulation_steps to run a pipeline schedule")
    return mbs, gas


PADDING = '--allow-padding-num-layers (ds_config "pipeline.allow_padding_num_layers": true)'


def check_layers(schedule: Schedule, num_layers: int, settings: PipelineSettings) -> None:
    """Layer counts the partition method can cut into the schedule's virtual stages. The cost
    methods ("flops", "costs:...") give stages unequal counts by design; pipe/plan/partition.py checks them."""
    if is_cost_method(settings.partition_method):
        return
    stages = schedule.stages
    if num_layers < stages:  # before the padding's advice: no padding gives an empty stage a layer
        raise ConfigError(too_few_layers(schedule, f"--num-layers {num_layers}", num_layers))
    if stages > schedule.pp and num_layers % stages and not settings.allow_padding_num_layers:
        raise ConfigError(f"schedule {schedule.name!r} cuts the model into {stages} virtual stages: "
                          f"--num-layers {num_layers} must be a multiple of {stages}, or give {PADDING} "
                          "to let some virtual stages hold one layer less")


def too_few_layers(schedule: Schedule, what: str, layers: int, layer: str = "transformer layer") -> str:
    """The line for a model of fewer layers than the schedule's virtual stages, with the ways out: a schedule of
    one stage per rank, or a smaller pipeline."""
    stages, pp = schedule.stages, schedule.pp
    per_rank = stages // pp
    ways = []
    if per_rank > 1 and layers >= pp:
        ways.append("a schedule of one virtual stage per rank (1f1b, zb-h1, zb-h2)")
    if layers // per_rank >= 1:
        ways.append(f"a pipeline size of at most {layers // per_rank}")
    if not ways:
        ways.append("a model of more layers")
    return (f"schedule {schedule.name!r} needs at least one {layer} per virtual stage: {what} < "
            f"{stages} virtual stages ({per_rank} per rank x pipeline size {pp}); choose " + " or ".join(ways))


def check_vocab_parallel_run(settings: PipelineSettings, config, pp: int) -> None:
    """What the engine's vocabulary passes (pipe/vocab/vocab_passes.py) do not combine with yet."""
    key = 'ds_config "pipeline.vocab_parallel" = true'
    if getattr(config, "liger_kernel", False):
        raise ConfigError(f"{key} with --use-liger-kernel: Liger's fused kernel computes the loss over the whole "
                          "vocabulary, and each rank holds a slice of it; --loss-chunk-size N runs the slices' "
                          "passes N tokens at a time instead")
    vocab = getattr(config, "vocab_size", None)  # known at parse when given (else the tokenizer pads it later)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if vocab and vocab % (pp * tp):
        ranks = f"{pp} pipeline ranks" if tp == 1 else f"{pp} pipeline x {tp} tensor-parallel ranks"
        raise ConfigError(f"{key}: the vocabulary of {vocab} rows does not split over the {ranks}; "
                          f"pad it to a multiple of {pp * tp} (--make-vocab-size-divisible-by)")


def check_context_parallel_run(settings: PipelineSettings, config) -> None:
    """What context parallelism does not combine with yet."""
    cp = f"--context-parallel-size {config.context_parallel_size}"
    if settings.auto_recompute:
        raise ConfigError(f'{cp} with ds_config "pipeline.auto_recompute": true: the recompute model '
                          "(schedules/recompute.layer_memory) counts a layer holding the whole sequence; give the "
                          "recompute flags yourself")
    moe = getattr(config, "moe", None)
    if moe is not None and moe.capacity_factor:
        raise ConfigError(f"{cp} with --moe-expert-capacity-factor: which tokens an expert drops depends on the "
                          "whole sequence, which each context-parallel rank holds 1/CP of; leave the factor out "
                          "(dropless)")


@dataclass(frozen=True)
class RankProgram:
    """What one rank runs for one batch size: its ops, the whole pipeline's messages, and for each
    op the messages whose receives to post when it starts."""
    schedule: Schedule
    ops: list
    messages: MessagePlan
    ahead: dict


@dataclass(frozen=True)
class PipelinePlan:
    """Frozen: a switch of schedule ("auto") is a new plan, which the engine then holds. `sequence_shards`:
    the TP size under sequence parallelism (a message holds 1/TP of the tokens), else 1; `context_shards`: the
    CP size (a message holds this context-parallel rank's 1/CP of the tokens). `make`: `(pp, m)`
    -> a searched schedule (schedules/auto.py) that "auto" switched to; None: the settings build it.
    An "auto" run's AutoPlan is not part of it: make_plan hands it out beside the plan, for the engine."""
    settings: PipelineSettings
    pp: int
    micro_batch_size: int
    micro_batches: int
    seq_length: int
    hidden_size: int
    segment_lengths: tuple | None = None
    sequence_shards: int = 1
    make: object = None
    documents: bool = False  # every stage reads the micro-batches' tokens: its layers need their documents
    context_shards: int = 1
    # memos of pure functions of the fields above (not state: a switch starts new ones)
    _schedules: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _programs: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.segment_lengths is not None:
            object.__setattr__(self, "segment_lengths", tuple(self.segment_lengths) or None)

    @classmethod
    def from_config(cls, config, ds_config: dict, pp: int, dp: int, seq_length: int | None = None,
                    settings: PipelineSettings | None = None) -> "PipelinePlan":
        """make_plan's plan, for callers that run no "auto" timing (an "auto" run starts on it untimed)."""
        return make_plan(config, ds_config, pp, dp, seq_length, settings)[0]

    @property
    def schedule(self) -> Schedule:
        return self.for_micro_batches(self.micro_batches)

    @property
    def placement(self) -> list:
        return self.schedule.placement

    @property
    def splits_backward(self) -> bool:
        """Whether any op of this run's schedule is a B (its weight gradients deferred to a W op)."""
        return any(op.kind is Kind.B for ops in self.schedule.ranks for op in ops)

    @property
    def activation_shape(self) -> tuple:
        return (self.micro_batch_size, self.seq_length, self.hidden_size)

    def for_micro_batches(self, m: int) -> Schedule:
        """This run's schedule for `m` micro-batches (eval and batch ramp-up use other counts)."""
        if m not in self._schedules:
            if self.make:  # a searched schedule (schedules/auto.py), after "auto" switched to it
                self._schedules[m] = self.make(self.pp, m)
            else:  # unequal segments: the generator holds no more tokens than 1F1B (schedules/token_cap.py)
                self._schedules[m] = self.settings.build_schedule(self.pp, m, self.segment_lengths)
        return self._schedules[m]

    def _settings_for(self, section: dict) -> PipelineSettings:
        # a section names the whole schedule: a knob (or "overlap") it leaves out is unset
        return dataclasses.replace(self.settings, **{**KNOBS, "overlap": False, **section})

    def places_alike(self, section: dict) -> bool:
        """Whether the schedule `section` names places the chunks as this plan's does."""
        return self._settings_for(section).build_schedule(self.pp, self.micro_batches).placement == self.placement

    def switch(self, section: dict, make=None, cuts: tuple = ()) -> "PipelinePlan":
        """The plan that runs the schedule a ds_config "pipeline" `section` names (or `make(pp, m)`'s,
        a searched one placed as `section`'s); it must place the chunks as the module was cut
        (another placement needs a new module: training/auto_schedule.py). A Seq1F1B section cuts the
        sequence as "auto" weighed it (`cuts`: its AutoPlan's)."""
        settings = self._settings_for(section)
        lengths = None
        if settings.seq_splits > 1:
            lengths = next(c.lengths for c in cuts if c.k == settings.seq_splits)
        new = dataclasses.replace(self, settings=settings, make=make, segment_lengths=lengths)
        if new.placement != self.placement:
            raise ValueError(f"{section} places chunks {new.placement}, the module holds {self.placement}")
        return new

    def program(self, rank: int, m: int, train: bool) -> RankProgram:
        """Rank `rank`'s ops for `m` micro-batches; evaluation runs the forwards only."""
        key = (rank, m, train)
        if key not in self._programs:
            sched = self.for_micro_batches(m)
            forwards = (Kind.F, Kind.EF, Kind.S)  # evaluation: the loss from the S passes' statistics
            op_lists = sched.ranks if train else [[op for op in ops if op.kind in forwards] for ops in sched.ranks]
            messages = MessagePlan(sched, op_lists, train)
            remote = {k for k, src in messages.source.items() if src != rank}
            self._programs[key] = RankProgram(sched, op_lists[rank], messages,
                                              lookahead(op_lists[rank], remote, reads(sched)))
        return self._programs[key]

    def segment(self, seq: int) -> slice:
        """The tokens of sequence segment `seq` (all of them when the sequence is not split)."""
        if self.segment_lengths is None:
            return slice(None)
        start = sum(self.segment_lengths[:seq])
        return slice(start, start + self.segment_lengths[seq])

    def segment_length(self, seq: int) -> int:
        """The token count of sequence segment `seq` (the sequence's when it is not split)."""
        return self.segment_lengths[seq] if self.segment_lengths else self.seq_length

    def message_shape(self, key: tuple) -> tuple:
        """(micro batch, tokens, hidden) of a message; its last field is the segment. Under context
        parallelism a message holds this CP rank's tokens, under sequence parallelism this TP rank's shard of
        them. A vocabulary message's last dimension is its own (vocab_messages.width)."""
        seq = self.local_length(key[-1])
        return (self.micro_batch_size, seq // token_shards(key, self.sequence_shards), width(key, self.hidden_size))

    def local_length(self, seq: int) -> int:
        """The tokens of segment `seq` (the sequence's when it is not split) one context-parallel rank holds."""
        return self.segment_length(seq) // self.context_shards

    def needs_data(self, rank: int) -> bool:
        """Whether `rank` holds the first stage (inputs) or the loss stage (labels) of a replica; under
        vocabulary parallelism every rank (its EF reads the tokens, its S the labels), and with packed
        documents that every stage's layers need (their boundaries come of the tokens)."""
        chunks = self.schedule.chunks_on(rank)
        return (self.settings.vocab_parallel or self.documents
                or any(st in (0, self.schedule.loss_stage) for _, st in chunks))


def make_plan(config, ds_config: dict, pp: int, dp: int, seq_length: int | None = None,
              settings: PipelineSettings | None = None, keys=None) -> tuple[PipelinePlan, AutoPlan | None]:
    """The plan for a model of `config`'s sizes (num_layers, hidden_size, ffn_hidden_size,
    max_position_embeddings) on pp x dp ranks, as the ds_config asks, and under "schedule": "auto" the
    AutoPlan of its start (else None), which the engine holds. `settings`: the "pipeline" section as
    parsed once at start-up (None: parsed here). `keys`: under a document mask, the keys its queries see on
    average (data/document_stats.py), which Seq1F1B's balanced cut weighs (None: causal attention's)."""
    settings = settings or pipeline_settings(ds_config)
    if settings.stock:
        raise ConfigError('a pipeline plan needs a named "pipeline.schedule" (DeepSpeed\'s own engine plans itself)')
    zero_stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if zero_stage != 1:
        raise ConfigError(f'schedule {settings.schedule!r} runs with ZeRO stage 1: set "zero_optimization": '
                          f'{{"stage": 1}} (it is {zero_stage})')
    mbs, gas = micro_batches_per_step(ds_config, dp)
    seq = seq_length or config.max_position_embeddings
    if settings.vocab_parallel:
        check_vocab_parallel_run(settings, config, pp)
    cp = getattr(config, "context_parallel_size", 1)
    if cp > 1:
        check_context_parallel_run(settings, config)
    auto_plan = None
    if settings.auto:
        settings, auto_plan = start_auto(settings, config, ds_config, pp, mbs, gas, seq, keys)
    try:
        schedule = settings.build_schedule(pp, gas)
    except ScheduleError as exc:
        raise ConfigError(f'ds_config "pipeline": {exc}') from None
    if schedule.vocab_parallel != settings.vocab_parallel:  # only a file can disagree: it carries its own ops
        raise ConfigError(f'ds_config "pipeline.schedule" = "{settings.schedule}": the file '
                          + ('places vocabulary passes (EF, S, T, EW); set "vocab_parallel": true to run them'
                             if schedule.vocab_parallel else 'has no vocabulary passes (EF, S, T, EW) for '
                             '"vocab_parallel": true; export it with them (python -m megatron_ds.schedules export '
                             '--vocab-parallel) or leave the key out'))
    moe = getattr(config, "moe", None)
    if moe is not None and moe.capacity_factor and schedule.seq_splits > 1:
        raise ConfigError("--moe-expert-capacity-factor with sequence segments (seq1f1b): which tokens an expert "
                          "drops depends on the whole sequence, which a segment has not seen yet; leave the factor "
                          "out (dropless) or choose a schedule without segments")
    check_layers(schedule, config.num_layers, settings)
    lengths = None
    if schedule.seq_splits > 1:  # a schedule file may carry its own cut
        lengths = schedule.segment_lengths or segment_lengths(settings, config, seq, keys)
        if sum(lengths) != seq:
            raise ConfigError(f'ds_config "pipeline.schedule" = "{settings.schedule}": segment_lengths {lengths} '
                              f"add up to {sum(lengths)} tokens, --seq-length is {seq}")
    shards = sequence_shards(getattr(config, "tensor_model_parallel_size", 1),
                             getattr(config, "sequence_parallel", False), seq, lengths)
    contexts = context_shards(cp, getattr(config, "tensor_model_parallel_size", 1),
                              getattr(config, "sequence_parallel", False), seq, lengths)
    documents = bool(getattr(config, "documents_in_every_stage", False))
    return PipelinePlan(settings, pp, mbs, gas, seq, config.hidden_size, lengths, shards,
                        documents=documents, context_shards=contexts), auto_plan
