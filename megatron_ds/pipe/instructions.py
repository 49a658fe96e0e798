"""A schedule's op lists as a DeepSpeed PipeSchedule: one instruction per IR op, or per overlapped unit.

The op kinds become instructions the engine maps to handlers, the way DeepSpeed's
TrainSchedule yields ForwardPass/BackwardPass; the two ops of an overlapped unit
(Schedule.overlap) become one OverlappedOps; the usual ReduceTiedGrads,
ReduceGrads and OptimizerStep close a training step.
"""
from deepspeed.runtime.pipe import schedule as ds_schedule

from megatron_ds.schedules.kinds import Kind


class OpInstruction(ds_schedule.PipeInstruction):
    """Runs one IR op; kwargs replica, stage, mb, seq."""


class LoadMicroBatches(ds_schedule.PipeInstruction):
    """Pull this step's micro-batches from the data iterator (ranks that need data)."""


class ForwardOp(OpInstruction):
    pass


class BackwardOp(OpInstruction):
    """Full backward (BW): input and weight gradients."""


class BackwardInputOp(OpInstruction):
    """B: input gradients now; linear-layer weight GEMMs queued for the matching W."""


class BackwardWeightOp(OpInstruction):
    """W: the queued weight GEMMs."""


class EmbeddingSliceForwardOp(OpInstruction):
    """EF: this rank's vocabulary rows of the embedding lookup."""


class OutputSlicePassOp(OpInstruction):
    """S: this rank's slice of the logits, their statistics and input-gradient share."""


class OutputSliceWeightOp(OpInstruction):
    """T: this rank's output-layer slice weight gradient."""


class EmbeddingSliceWeightOp(OpInstruction):
    """EW: this rank's embedding rows' weight gradient."""


class OverlappedOps(ds_schedule.PipeInstruction):
    """An overlapped unit (pipe/moe/overlap.py): kwarg `ops`, its two ops (an F and a B or BW) in list order."""


class ReduceReplicaGrads(ds_schedule.PipeInstruction):
    """Finish the twin-chunk gradient all-reduces of a two-replica schedule."""


class FinishIteration(ds_schedule.PipeInstruction):
    """End of the op list: wait for outstanding sends, check that every message was consumed and that no
    activation, deferred W or K/V cache was left behind, and drop the iteration's micro-batches."""


KIND_TO_INSTRUCTION = {Kind.F: ForwardOp, Kind.BW: BackwardOp, Kind.B: BackwardInputOp, Kind.W: BackwardWeightOp,
                       Kind.EF: EmbeddingSliceForwardOp, Kind.S: OutputSlicePassOp, Kind.T: OutputSliceWeightOp,
                       Kind.EW: EmbeddingSliceWeightOp}
INSTRUCTION_TO_KIND = {cls.__name__: kind for kind, cls in KIND_TO_INSTRUCTION.items()}


class OpListSchedule(ds_schedule.PipeSchedule):
    """One rank's op list; `paired`: the positions where an overlapped unit of two ops starts; `train` appends the
    gradient reduction and the optimizer step."""

    def __init__(self, ops, micro_batches, stages, stage_id, train=True, paired=frozenset()):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.ops, self.train, self.paired = ops, train, paired

    def steps(self):
        yield [LoadMicroBatches()]
        i = 0
        while i < len(self.ops):
            if i in self.paired:
                yield [OverlappedOps(ops=(self.ops[i], self.ops[i + 1]))]
                i += 2
                continue
            op = self.ops[i]
            yield [KIND_TO_INSTRUCTION[op.kind](replica=op.replica, stage=op.stage, mb=op.mb, seq=op.seq)]
            i += 1
        yield [FinishIteration()]
        if self.train:
            yield [ReduceReplicaGrads(), ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(),
                   ds_schedule.OptimizerStep()]

    def num_pipe_buffers(self):
        return 1  # the engine keeps its own per-(replica, stage, mb, seq) buffers
