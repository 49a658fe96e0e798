"""Pipeline schedules as data (pure Python, no torch): IR, generators, validator, simulator, renderer.

A schedule is, for every pipeline rank, the ordered list of compute ops it runs; the
runtime in megatron_ds.pipe executes exactly these lists. catalog.CATALOG lists them all.
"""
from .ir import KINDS, Op, Schedule, ScheduleError, order_text
from .validate import validate
from .catalog import CATALOG, ScheduleSpec, build_schedule
from .simulate import SimResult, simulate

__all__ = ["KINDS", "Op", "Schedule", "ScheduleError", "CATALOG", "ScheduleSpec", "build_schedule",
           "validate", "order_text", "simulate", "SimResult"]
