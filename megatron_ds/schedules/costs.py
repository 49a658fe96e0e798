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
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Schedule
from .simulate import SimResult, simulate

Triple = tuple[float, float, float]


@dataclass(frozen=True)
class ModelCosts:
    tf: float = 1.0
    tb: float = 1.0
    tw: float = 1.0
    embed: Triple = (0.0, 0.0, 0.0)   # (F, B, W) of the embedding, on stage 0
    head: Triple = (0.0, 0.0, 0.0)    # (F, B, W) of the LM head and loss, on the last stage
    op_overhead: Triple = (0.0, 0.0, 0.0)  # (F, B, W) time every op pays on top of its share
    head_memory: float = 0.0          # one micro-batch's logits, in one 1F1B stage's activations

    def per_stage(self, schedule: Schedule) -> tuple[list[float], list[float], list[float]]:
        """(tf, tb, tw) lists, one entry per stage of a replica, as simulate() takes them."""
        body = schedule.pp / schedule.stages
        out = []
        for i, t in enumerate((self.tf, self.tb, self.tw)):
            costs = [t * body] * schedule.stages
            if not schedule.vocab_parallel:
                costs[0] += self.embed[i]
                costs[-1] += self.head[i]
            out.append(costs)
        return out[0], out[1], out[2]

    def balanced(self, pp: int) -> "ModelCosts":
        """The same model with the embedding's and the head's (F, B, W) spread evenly over the p
        1F1B stages (each kind into its own kind), no vocabulary passes and no logits held."""
        spread = [t + (e + h) / pp for t, e, h in zip((self.tf, self.tb, self.tw), self.embed, self.head)]
        return ModelCosts(*spread, op_overhead=self.op_overhead)


def evaluate(schedule: Schedule, costs: ModelCosts, **kwargs) -> SimResult:
    """simulate() with the model's costs cut to this schedule's stages (kwargs: simulate's)."""
    vocab = {"head": costs.head, "embed": costs.embed} if schedule.vocab_parallel else {}
    return simulate(schedule, *costs.per_stage(schedule), op_overhead=costs.op_overhead,
                    head_memory=costs.head_memory, **vocab, **kwargs)
