"""Recompute as one of "auto"'s knobs (ds_config "pipeline.auto_recompute": true): besides the schedule, "auto"
chooses per run whether the layers recompute nothing, their attention core (selective) or all of themselves
(full, uniform groups of one layer), whichever is fastest among what fits the memory budget (pure data).

Every candidate schedule is weighed under each of the three settings (`KNOBS`) by schedules/recompute.py's
model: what a layer keeps for backward under each (`layer_memory`, in bytes) and what each B pays again (the
forward of what its chunk recomputes: the attention core's share of a layer's forward FLOPs for selective,
the whole layer for full). Its memory unit is the budget's: one micro-batch's activations on one 1F1B stage
with nothing recomputed (the layers' `kept`; a byte budget's unit, auto.unit_bytes, scaled to it).

At start-up nothing is timed: the run starts on the first start-up candidate (auto.starts) that fits under
the least recompute that lets one fit (none, then selective, then full), so its timed B includes that
setting's recomputation, which `unrecomputed` takes out of the measured costs again before the decision.
Which kernel runs the attention core (fused or not: the core keeps (s x s) tensors only unfused) is known on
the device: start-up counts the fused kernel's, whose selective recompute saves least (`cuda`: True), and the
decision the device's own (`on_device`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import auto
from .context_parallel import cp_layer_memory
from .costs import ModelCosts
from .ir import ScheduleError
from .flops import attention_flops, layer_shape, query_width, span_flops
from .recompute import LayerMemory, Recompute, evaluate, layer_memory, recomputed_share

KNOBS = (Recompute(), Recompute("selective"), Recompute("full", "uniform", 1))  # cheapest first


def as_dict(recompute: Recompute) -> dict:
    """The JSON form of a setting (a decision's "recompute", GPTConfig's recompute_* fields)."""
    return {"granularity": recompute.granularity, "method": recompute.method, "num_layers": recompute.num_layers}


def of_dict(data: dict) -> Recompute:
    return Recompute(data.get("granularity"), data.get("method"), data.get("num_layers"))


def core_share(config, seq: int) -> float:
    """The attention core's share of one layer's forward FLOPs at `seq` tokens (schedules/flops.py: causal)."""
    shape = layer_shape(config)
    core = attention_flops(0, seq, query_width(shape["hidden"], shape["heads"], shape["head_dim"]))
    return core / span_flops(0, seq, **shape)


@dataclass(frozen=True)
class Knobs:
    """What "auto" needs to weigh the settings: the layer's memory on either kind of device (fused attention
    on CUDA, `memories[True]`; torch's CPU kernels, `memories[False]`), which one counts (`cuda`), the model's
    layer count, the core's share of a layer's forward, and `unit_bytes`: the budget's unit in bytes when the
    budget was given in bytes (auto.unit_bytes), else None (the budget counts the layers' own unit)."""
    memories: tuple
    cuda: bool
    num_layers: int
    pp: int
    core_share: float
    unit_bytes: float | None = None

    @classmethod
    def of(cls, config, seq: int, mbs: int, dtype_bytes: int, pp: int, unit_bytes: float | None = None,
           context_parallel: int = 1, cp_comm_type: str = "p2p") -> "Knobs":
        """At CP C a rank's layer holds seq / C tokens and what its attention's communication keeps
        (context_parallel.cp_layer_memory, the fused core's on either device); the core's share of its time is
        the whole sequence's (a rank's attention and linear layers both do 1/C of theirs)."""
        if context_parallel > 1:
            memory = cp_layer_memory(config, seq, mbs, dtype_bytes, context_parallel, cp_comm_type)
            memories = (memory, memory)
        else:
            memories = tuple(layer_memory(config, seq, mbs, dtype_bytes, cuda=c) for c in (False, True))
        return cls(memories, True, config.num_layers, pp, core_share(config, seq), unit_bytes)

    settings = KNOBS

    def on_device(self, cuda: bool) -> "Knobs":
        return dataclasses.replace(self, cuda=cuda)

    @property
    def memory(self) -> LayerMemory:
        return self.memories[self.cuda]

    @property
    def scale(self) -> float:
        """The layers' own unit (memory.kept x layers / pp bytes) in the budget's unit."""
        own = self.memory.kept * self.num_layers / self.pp
        return own / self.unit_bytes if self.unit_bytes else 1.0

    def evaluate(self, schedule, costs: ModelCosts, recompute: Recompute, **kwargs):
        """(simulate's result, its peak memory in the budget's unit) of `schedule` under `recompute`;
        `costs.head_memory` in the budget's unit too."""
        own = dataclasses.replace(costs, head_memory=costs.head_memory / self.scale)
        res = evaluate(schedule, own, recompute, self.memory, self.num_layers, self.core_share, **kwargs)
        return res, res.peak_memory_max * self.scale

    def peak(self, schedule, recompute: Recompute, head_memory: float = 0.0) -> float:
        return self.evaluate(schedule, ModelCosts(head_memory=head_memory), recompute)[1]

    def unrecomputed(self, costs: ModelCosts, recompute: Recompute) -> ModelCosts:
        """Costs timed under `recompute` as they would be without it: each layer's B less the forward it ran
        again (every stage holds whole layers, so a 1F1B stage's B gives back its share of its F)."""
        share = recomputed_share(recompute, 1, self.core_share)
        if not share:
            return costs
        layers = tuple((f, max(0.0, b - share * f), w) for f, b, w in costs.layers)
        return dataclasses.replace(costs, tb=max(0.0, costs.tb - share * costs.tf), layers=layers)

    def entry(self, recompute: Recompute, rows: list) -> dict:
        """A decision entry's recompute part (auto.decide): the setting, and the fastest fitting row under each
        setting (why it was chosen)."""
        best = {}
        for r in self.settings:
            row = next((row for row in rows if row["recompute"] == r), None)  # rows: fastest first
            best[r.label] = {"label": row["candidate"].label, "makespan": row["makespan"]} if row else None
        return {"recompute": as_dict(recompute), "recompute_label": recompute.label, "recompute_options": best}


def start(budget: float, pp: int, m: int, num_layers: int, knobs: Knobs, cuts: tuple = (), *,
          vocab_parallel: bool = False, head_memory: float = 0.0):
    """(the candidate to start on, its recompute setting, its probe or None): auto.check_budget's start under the
    least recompute that lets one fit; ScheduleError naming the smallest budget that fits when none does."""
    space = dict(vocab_parallel=vocab_parallel, head_memory=head_memory)
    first = auto.starts(pp, m, num_layers, cuts, vocab_parallel=vocab_parallel)
    for recompute in knobs.settings:
        peak = lambda schedule, head, r=recompute: knobs.peak(schedule, r, head)  # noqa: E731
        memory = dict(auto.memory_table(pp, m, num_layers, cuts, peak=peak, **space))
        fits = next((c for c in first if memory[c] <= budget + auto.EPS), None)
        if fits is not None:
            return fits, recompute, auto.probe(fits, budget, pp, m, num_layers, cuts, peak=peak, **space)
    least = knobs.settings[-1]
    memory = dict(auto.memory_table(pp, m, num_layers, cuts, peak=lambda s, h: knobs.peak(s, least, h), **space))
    smallest = min(memory[c] for c in first)
    exc = ScheduleError(f"memory_budget {budget:.4g} fits no schedule that splits the backward at pp={pp}, {m} "
                        f"micro-batches, even recomputing every layer ({least.label}); the smallest budget that "
                        f"fits is {smallest:g}")
    exc.smallest = smallest
    raise exc
