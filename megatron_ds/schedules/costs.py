"""Costs that do not depend on the schedule, for comparing schedules on one model.

The simulator takes times per stage of a schedule, and schedules cut the model into
different numbers of stages (p, 2p, v*p). `ModelCosts` states the model once: the
transformer layers as (TF, TB, TW) of one 1F1B stage (1/p of them), plus the embedding and
the LM head with its loss as extra (F, B, W) times on the first and the last stage of every
replica. A 50k-token vocabulary makes the head as heavy as several layers, and under the V
schedules (zbv, dualpipev) rank 0 holds both it and the embedding. `evaluate` is what a
schedule chooser needs: build each candidate, evaluate it on the same ModelCosts, compare.
`op_overhead` is the fixed time (F, B, W) each op pays whatever its size: it makes schedules of
many small ops (sequence segments, V chunks) dearer than their shares of the work.
Under vocab_parallel the embedding and the head leave stage 0 and the loss stage: each rank's
vocabulary passes carry 1/p of them (simulate's `head`, `embed`). `head_memory` is what one
micro-batch's logits hold, in the activation unit (simulate's). `balanced` is the ideal that
vocabulary parallelism is judged against: the embedding's and the head's times spread evenly over
the p ranks at no overhead.

Mixture of experts: when the transformer layers differ (MoE layers among dense ones, --moe-layer-freq),
`layers` gives each layer's own (F, B, W) compute and a stage costs the layers it holds, cut as
DeepSpeed's count-balanced default does ("type:transformer": the first L % S stages one layer more);
tf, tb, tw are then their mean per 1F1B stage. `all_to_all` gives each layer's expert-parallel
all-to-all time in its F and its B (dispatch and combine, or their reverse; 0 for a dense layer):
communication, kept apart from the compute because overlapping it (overlapped units) would hide it, and charged
on the critical path of the F and B ops for now, as the runtime runs it inside the layer. `layer_memory`
gives each layer's activations (any unit: only their ratios count), so a stage of MoE layers holds more
than one of dense layers.

Overlapped units: `piece_host` is the host time one piece of an overlapped unit costs beyond the plain
op (each launch, stream event and wait the piece-by-piece run adds): a MoE layer runs as PIECES_MOE pieces per
side (attention, dispatch, experts, combine; backward the reverse), a dense layer as one, so a unit pays
piece_host times the pieces of both its stages (`overlap_host_per_stage`; simulate's `overlap_host`). The unit runs
piece by piece in the simulation too: a MoE layer's F issues A2A_PER_MOE_LAYER[0] all-to-alls and its B [1]
(`all_to_all_count_per_stage`; simulate's `all_to_all_count`), each a hand-over to the other side.

Context parallelism (schedules/context_parallel.py builds such costs from a model's shape): tf, tb, tw are one
CP rank's compute at S / C tokens, and `context` the (F, B) time per 1F1B stage of the attention's communication
(the ring's, the all-gather's or the all-to-all's) that the compute does not hide, on the critical path of F and
of B (BW) as the runtime runs it inside the layer. Measured costs ("auto") hold it in their op times already.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Schedule
from .simulate import SimResult, simulate

Triple = tuple[float, float, float]
PIECES_MOE = 4   # a MoE layer's pieces per side of an overlapped unit: attention, dispatch, experts, combine
A2A_PER_MOE_LAYER = (3, 2)  # all-to-alls a MoE layer issues in its forward and its backward (model/moe_dispatch.py)


@dataclass(frozen=True)
class ModelCosts:
    tf: float = 1.0
    tb: float = 1.0
    tw: float = 1.0
    embed: Triple = (0.0, 0.0, 0.0)   # (F, B, W) of the embedding, on stage 0
    head: Triple = (0.0, 0.0, 0.0)    # (F, B, W) of the LM head and loss, on the last stage
    op_overhead: Triple = (0.0, 0.0, 0.0)  # (F, B, W) time every op pays on top of its share
    head_memory: float = 0.0          # one micro-batch's logits, in one 1F1B stage's activations
    layers: tuple = ()                # per transformer layer, its (F, B, W) when they differ (MoE); (): all alike
    all_to_all: tuple = ()            # per transformer layer, (F, B) of its expert-parallel all-to-all; (): none
    layer_memory: tuple = ()          # per transformer layer, its activations (relative); (): all alike
    piece_host: float = 0.0           # host time per piece of an overlapped unit (PIECES_MOE a MoE layer, 1 dense)
    context: tuple = (0.0, 0.0)       # (F, B) per 1F1B stage: the context-parallel communication left unhidden

    @classmethod
    def of_layers(cls, layers, pp: int, **kwargs) -> "ModelCosts":
        """Costs of per-layer (F, B, W) times, tf, tb, tw their mean per 1F1B stage (kwargs: the other fields)."""
        layers = tuple(tuple(float(x) for x in t) for t in layers)
        return cls(*(sum(t[i] for t in layers) / pp for i in range(3)), layers=layers, **kwargs)

    def per_stage(self, schedule: Schedule) -> tuple[list[float], list[float], list[float]]:
        """(tf, tb, tw) lists, one entry per stage of a replica, as simulate() takes them."""
        body = schedule.pp / schedule.stages
        cut = stage_layers(len(self.layers), schedule.stages) if self.layers else None
        out = []
        comm = (*self.context, 0.0)  # per stage as the layers it holds (W has none)
        shares = [len(held) * schedule.pp / len(self.layers) for held in cut] if cut else [body] * schedule.stages
        for i, t in enumerate((self.tf, self.tb, self.tw)):
            costs = [sum(self.layers[j][i] for j in held) for held in cut] if cut else [t * body] * schedule.stages
            costs = [c + comm[i] * share for c, share in zip(costs, shares)]
            if not schedule.vocab_parallel:
                costs[0] += self.embed[i]
                costs[-1] += self.head[i]
            out.append(costs)
        return out[0], out[1], out[2]

    def all_to_all_per_stage(self, schedule: Schedule) -> tuple[list[float], list[float]] | None:
        """(F, B) lists of the all-to-all time inside each stage's ops, as simulate()'s all_to_all; None: none."""
        if not self.all_to_all:
            return None
        cut = stage_layers(len(self.all_to_all), schedule.stages)
        return tuple([sum(self.all_to_all[j][i] for j in held) for held in cut] for i in range(2))

    def all_to_all_count_per_stage(self, schedule: Schedule) -> tuple[list[int], list[int]] | None:
        """(F, B) lists of the all-to-alls inside each stage's ops (A2A_PER_MOE_LAYER a layer with an all-to-all),
        as simulate()'s all_to_all_count; None: none."""
        if not self.all_to_all:
            return None
        cut = stage_layers(len(self.all_to_all), schedule.stages)
        return tuple([sum(n for j in held if any(self.all_to_all[j])) for held in cut] for n in A2A_PER_MOE_LAYER)

    def all_to_all_args(self, schedule: Schedule) -> dict:
        """simulate()'s keywords for the expert-parallel all-to-all: its time and count inside the ops, and what
        an overlapped unit's pieces add (nothing without an all-to-all)."""
        args = {}
        if self.all_to_all:
            args.update(all_to_all=self.all_to_all_per_stage(schedule),
                        all_to_all_count=self.all_to_all_count_per_stage(schedule))
        if self.piece_host and schedule.overlap:
            args["overlap_host"] = self.overlap_host_per_stage(schedule)
        return args

    def pieces_per_stage(self, schedule: Schedule) -> list[int]:
        """The pieces one side of an overlapped unit runs on each stage: PIECES_MOE per layer with an
        all-to-all, one per other layer (without per-layer costs: one per stage)."""
        if self.all_to_all:
            per = [PIECES_MOE if any(t) else 1 for t in self.all_to_all]
        elif self.layers:
            per = [1] * len(self.layers)
        else:
            return [1] * schedule.stages
        return [sum(per[j] for j in held) for held in stage_layers(len(per), schedule.stages)]

    def overlap_host_per_stage(self, schedule: Schedule) -> list[float]:
        """simulate()'s overlap_host: what one side of an overlapped unit adds on each stage."""
        return [self.piece_host * n for n in self.pieces_per_stage(schedule)]

    def stage_memory(self, schedule: Schedule) -> list[float] | None:
        """Each stage's activations over an even share's (simulate's stage_memory); None: all alike."""
        if not self.layer_memory:
            return None
        cut, total = stage_layers(len(self.layer_memory), schedule.stages), sum(self.layer_memory)
        return [sum(self.layer_memory[j] for j in held) * schedule.stages / total for held in cut]

    def op_times(self, schedule: Schedule) -> tuple[list[float], list[float], list[float]]:
        """per_stage with the all-to-all added to F and B: what an op takes, compute and communication."""
        f, b, w = self.per_stage(schedule)
        comm = self.all_to_all_per_stage(schedule)
        if comm:
            f, b = [x + y for x, y in zip(f, comm[0])], [x + y for x, y in zip(b, comm[1])]
        return f, b, w

    def mean_op_times(self, pp: int) -> Triple:
        """(F, B, W) of one 1F1B stage of p, compute and communication: tf, tb, tw with 1/p of the layers'
        all-to-all and the context-parallel communication left unhidden."""
        f, b = (sum(t[i] for t in self.all_to_all) / pp for i in range(2))
        return self.tf + f + self.context[0], self.tb + b + self.context[1], self.tw

    def balanced(self, pp: int) -> "ModelCosts":
        """The same model with the embedding's and the head's (F, B, W) spread evenly over the p
        1F1B stages (each kind into its own kind), no vocabulary passes and no logits held."""
        spread = [t + (e + h) / pp for t, e, h in zip((self.tf, self.tb, self.tw), self.embed, self.head)]
        layers = tuple(tuple(t + (e + h) / len(self.layers) for t, e, h in zip(layer, self.embed, self.head))
                       for layer in self.layers)
        return ModelCosts(*spread, op_overhead=self.op_overhead, layers=layers, all_to_all=self.all_to_all,
                          layer_memory=self.layer_memory, piece_host=self.piece_host, context=self.context)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The transformer layers (0-based) of each stage of a replica under DeepSpeed's count-balanced cut
    ("type:transformer", partition_uniform): L // S each, the first L % S stages one more."""
    per, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def evaluate(schedule: Schedule, costs: ModelCosts, **kwargs) -> SimResult:
    """simulate() with the model's costs cut to this schedule's stages (kwargs: simulate's)."""
    vocab = {"head": costs.head, "embed": costs.embed} if schedule.vocab_parallel else {}
    moe = costs.all_to_all_args(schedule)
    if costs.layer_memory and kwargs.get("act_size") is None:
        moe["stage_memory"] = costs.stage_memory(schedule)
    return simulate(schedule, *costs.per_stage(schedule), op_overhead=costs.op_overhead,
                    head_memory=costs.head_memory, **vocab, **moe, **kwargs)
