"""The out-of-memory line (training/faults/out_of_memory.py) from an engine's running op, in one process; the
multi-rank run (injected allocator failure, every rank's exit) is in test_out_of_room.py."""
from types import SimpleNamespace

import pytest

from megatron_ds.training.faults import out_of_memory
from megatron_ds.training.config.arguments import ArgumentsError


def _watch(engine):
    args = SimpleNamespace(micro_batch_size=4, checkpoint_activations=True,
                           pipeline_settings=SimpleNamespace(memory_budget="24GiB", seq_splits=2), inject_oom=None)
    out_of_memory._state.update(engine=engine, args=args)


def test_line_names_rank_stage_op_peak_and_knobs():
    running = ("BackwardInputOp", {"replica": 1, "stage": 2, "mb": 5, "seq": 1})
    _watch(SimpleNamespace(stage_id=3, global_steps=6, tracer=SimpleNamespace(running=running)))
    line = out_of_memory.describe(MemoryError(), 7)
    assert line.startswith("rank 7, pipeline stage 3: out of memory in B of micro-batch 5 (replica 1, virtual stage 2, "
                           "segment 1) at iteration 7: MemoryError; ")
    assert " GiB resident (peak); to lower it: lower --micro-batch-size (now 4); with \"schedule\": \"auto\" a " \
           "smaller pipeline.memory_budget (now 24GiB); activation checkpointing --checkpoint-activations (now on); more " \
           "Seq1F1B segments pipeline.seq_splits (now 2)" in line


def test_an_overlapped_unit_names_both_its_ops():
    from megatron_ds.schedules import Op
    from megatron_ds.schedules.kinds import Kind
    running = ("OverlappedOps", {"ops": (Op(Kind.F, 0, 1, 6, 0), Op(Kind.BW, 0, 1, 3, 0))})
    _watch(SimpleNamespace(stage_id=1, global_steps=2, tracer=SimpleNamespace(running=running)))
    assert ("out of memory in the overlapped unit of F of micro-batch 6 (replica 0, virtual stage 1) and BW of "
            "micro-batch 3 (replica 0, virtual stage 1) at iteration 3: MemoryError") in out_of_memory.describe(
        MemoryError(), 1)


def test_deepspeeds_own_engine_names_its_instruction():
    def _exec_backward_pass():
        pass
    _watch(SimpleNamespace(stage_id=0, global_steps=0, tracer=None, _exec_instr=_exec_backward_pass))
    assert "out of memory in _exec_backward_pass at iteration 1: no room" in out_of_memory.describe(
        MemoryError("no room"), 0)
    out_of_memory._state.update(engine=None, args=None)


def test_inject_oom_takes_rank_iteration_and_micro_batch():
    with pytest.raises(ArgumentsError, match=r"--inject-oom takes RANK ITER \[MB\], got 1 numbers"):
        out_of_memory.check_out_of_memory_args(SimpleNamespace(inject_oom=[1]))
    out_of_memory.check_out_of_memory_args(SimpleNamespace(inject_oom=[1, 4, 0]))
