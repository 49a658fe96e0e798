"""The schedule IR of DESIGN.md: per-rank ordered lists of compute ops, and its JSON form.

The JSON layout is a contract read by tools outside this package, so the field names
and their order here follow DESIGN.md exactly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from megatron_ds.errors import UserError

from .kinds import Kind

KINDS = tuple(Kind)


class ScheduleError(UserError, ValueError):
    """A schedule setting or op list breaks a rule; the message names the setting, value and rule."""


@dataclass(frozen=True)
class Op:
    kind: Kind
    replica: int
    stage: int
    mb: int
    seq: int = 0

    def __post_init__(self):
        if type(self.kind) is not Kind:
            if self.kind not in KINDS:
                raise ScheduleError(f"bad op kind {self.kind!r}: must be one of {', '.join(KINDS)}")
            object.__setattr__(self, "kind", Kind(self.kind))
        # Ops are dict keys in every simulation and list scheduling: hash and compare one tuple, once made.
        key = (str(self.kind), self.replica, self.stage, self.mb, self.seq)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt through __init__: a str's hash differs from process to process (spawned ranks).
        return (Op, (self.kind, self.replica, self.stage, self.mb, self.seq))

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Op and self._hash == other._hash and self._key == other._key)

    def to_dict(self) -> dict:
        return {"op": self.kind, "replica": self.replica, "stage": self.stage,
                "mb": self.mb, "seq": self.seq}

    @classmethod
    def from_dict(cls, d: dict) -> "Op":
        try:
            kind, ints = str(d["op"]), (int(d["replica"]), int(d["stage"]), int(d["mb"]), int(d.get("seq", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"bad op entry {d!r}: needs op, replica, stage, mb (and seq)") from exc
        if kind not in KINDS:
            raise ScheduleError(f"bad op kind {kind!r} in {d!r}: must be one of {', '.join(KINDS)}")
        return cls(Kind(kind), *ints)

    @property
    def unit(self) -> tuple[int, int, int, int]:
        """The (replica, stage, mb, seq) work unit this op belongs to."""
        return (self.replica, self.stage, self.mb, self.seq)

    def __str__(self) -> str:
        return f"{self.kind}(r{self.replica},s{self.stage},mb{self.mb},q{self.seq})"


@dataclass
class Schedule:
    name: str
    pp: int
    micro_batches: int
    replicas: int
    stages: int
    seq_splits: int
    placement: list[list[int]]
    ranks: list[list[Op]] = field(default_factory=list)
    segment_lengths: list[int] | None = None  # tokens of each sequence segment, when the generator was told
    vocab_parallel: bool = False  # every rank runs the vocabulary passes (EF, S, T, EW) on its slice
    # Overlapped units: per rank, the positions i at which op i (a forward) and op i+1 (a backward of
    # another unit), or the reverse, run as one unit, each one's all-to-all hidden behind the other's compute.
    # None: no op runs overlapped. An executor that runs the two one after the other runs the same schedule.
    overlap: list[list[int]] | None = None

    def __post_init__(self):
        if self.overlap is not None and not any(self.overlap):  # no unit: the same schedule as without the field
            self.overlap = None

    @property
    def loss_stage(self) -> int:
        return self.stages - 1

    def rank_of(self, replica: int, stage: int) -> int:
        return self.placement[replica][stage]

    def chunks_on(self, rank: int) -> list[tuple[int, int]]:
        return sorted((rep, st) for rep, row in enumerate(self.placement)
                      for st, r in enumerate(row) if r == rank)

    def chunk_index(self, rank: int, op: Op) -> int:
        """How many chunks of op's replica `rank` holds before op's stage (a V's second leg: 1).
        Labels prime it and pictures shade it darker."""
        if op.kind.traits.vocab:  # a vocabulary slice is no chunk of the replica's pipeline
            return 0
        return sum(1 for rep, st in self.chunks_on(rank) if rep == op.replica and st < op.stage)

    def op_label(self, rank: int, op: Op) -> str:
        """Short label for logs and pictures: kind and micro-batch (".q" when the sequence is
        split), one prime per earlier chunk of the same replica on the rank (a V's second
        leg: F3'), lower case for replica 1 of a bidirectional schedule."""
        text = (op.kind if op.replica == 0 else op.kind.lower()) + str(op.mb)
        if self.seq_splits > 1:
            text += f".{op.seq}"
        return text + "'" * self.chunk_index(rank, op)

    def paired_at(self, rank: int) -> frozenset:
        """The positions of `rank`'s list where an overlapped unit starts (its two ops: i and i+1)."""
        if not self.overlap or rank >= len(self.overlap):
            return frozenset()
        return frozenset(self.overlap[rank])

    def units(self, rank: int) -> list[tuple[Op, ...]]:
        """`rank`'s list as it runs: one op, or the two ops of an overlapped unit, in list order."""
        lst, starts = self.ranks[rank], self.paired_at(rank)
        out, i = [], 0
        while i < len(lst):
            n = 2 if i in starts and i + 1 < len(lst) else 1
            out.append(tuple(lst[i:i + n]))
            i += n
        return out

    def pairs(self) -> Iterator[tuple[int, Op, Op]]:
        """(rank, first op, second op) of every overlapped unit."""
        for r in range(len(self.ranks)):
            for unit in self.units(r):
                if len(unit) == 2:
                    yield r, unit[0], unit[1]

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """(rank, position, op) for every op of every rank."""
        for r, lst in enumerate(self.ranks):
            for i, op in enumerate(lst):
                yield r, i, op

    def num_ops(self) -> int:
        return sum(len(lst) for lst in self.ranks)

    def mb_replica(self) -> dict[int, int]:
        """Which replica each micro-batch runs on (taken from its ops)."""
        return {op.mb: op.replica for _, _, op in self.ops()}

    def to_dict(self) -> dict:
        head = {"schedule": self.name, "pp": self.pp, "micro_batches": self.micro_batches,
                "replicas": self.replicas, "stages": self.stages, "seq_splits": self.seq_splits}
        if self.segment_lengths is not None:
            head["segment_lengths"] = list(self.segment_lengths)
        if self.vocab_parallel:
            head["vocab_parallel"] = True
        if self.overlap and any(self.overlap):
            head["overlap"] = [sorted(row) for row in self.overlap]
        return {**head, "placement": [list(row) for row in self.placement],
                "ranks": [[op.to_dict() for op in lst] for lst in self.ranks]}

    def to_json(self, indent: int | None = None) -> str:
        if indent is None:
            return json.dumps(self.to_dict())
        # One op per line keeps exported files diffable without exploding into 7 lines per op.
        head = {k: v for k, v in self.to_dict().items() if k not in ("placement", "ranks")}
        lines = ["{"]
        for k, v in head.items():
            lines.append(f'  {json.dumps(k)}: {json.dumps(v)},')
        lines.append(f'  "placement": {json.dumps(self.placement)},')
        lines.append('  "ranks": [')
        for r, lst in enumerate(self.ranks):
            ops = ",\n".join("      " + json.dumps(op.to_dict()) for op in lst)
            tail = "," if r < len(self.ranks) - 1 else ""
            lines.append("    [\n" + ops + "\n    ]" + tail if lst else "    []" + tail)
        lines.append("  ]")
        lines.append("}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        missing = [k for k in ("schedule", "pp", "micro_batches", "replicas", "stages",
                               "seq_splits", "placement", "ranks") if k not in d]
        if missing:
            raise ScheduleError(f"schedule JSON lacks key(s) {', '.join(missing)}")
        if not isinstance(d.get("vocab_parallel", False), bool):
            raise ScheduleError(f"schedule JSON vocab_parallel={d['vocab_parallel']!r}: must be true or false")
        overlap = d.get("overlap")
        if overlap is not None and not (isinstance(overlap, list) and all(
                isinstance(row, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in row)
                for row in overlap)):
            raise ScheduleError(f"schedule JSON overlap={overlap!r}: must be one list of op positions per rank")
        return cls(name=str(d["schedule"]), pp=int(d["pp"]), micro_batches=int(d["micro_batches"]),
                   replicas=int(d["replicas"]), stages=int(d["stages"]),
                   seq_splits=int(d["seq_splits"]),
                   placement=[[int(r) for r in row] for row in d["placement"]],
                   ranks=[[Op.from_dict(o) for o in lst] for lst in d["ranks"]],
                   segment_lengths=None if d.get("segment_lengths") is None
                   else [int(n) for n in d["segment_lengths"]],
                   vocab_parallel=bool(d.get("vocab_parallel", False)),
                   overlap=None if overlap is None else [list(row) for row in overlap])

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"schedule JSON does not parse: {exc}") from exc
        if not isinstance(d, dict):
            raise ScheduleError("schedule JSON must be an object")
        return cls.from_dict(d)


def order_text(schedule: Schedule, ranks: Iterable[int] | None = None) -> str:
    """Per-rank op order, one line per rank ("rank0: F0 F1 BW0 ..."; "F3+BW1" an overlapped unit), labels as
    op_label."""
    lines = []
    for r in (range(schedule.pp) if ranks is None else ranks):  # an overlapped unit: its two labels joined by "+"
        lines.append(f"rank{r}: " + " ".join("+".join(schedule.op_label(r, op) for op in unit)
                                             for unit in schedule.units(r)))
    return "\n".join(lines)
