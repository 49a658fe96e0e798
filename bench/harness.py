"""What the benches repeat: flags, the paired timing loop, the machine noted, the table, the docs/perf file.

- `alternated`: every contestant (an engine, a setting) runs once per iteration after a barrier, timed by the
  wall clock (or a `Timer`), the order reversed every other iteration, so that a drift of the load hits all alike;
  `paired_ratio` is the median of the ratios of neighbouring iterations (slow drifts cancel), `medians` each
  contestant's median after the warm-up.
- `Timer`: a region's seconds, CUDA events on a CUDA device.
- `Machine`: the load average and the cores, at the start and at the end, in the two forms the outputs use.
- `best_of`: the fastest of a few repeats of one thing (what a bench of a single process times).
- `rounds`: the cells of a launch-per-cell bench, round after round, every other round reversed (drifts hit all).
- `table` / `row`: a markdown table from a header, column alignments and rows of cells; one row.
- `parser`: the bench's flags: its docstring's first line, the model flags it names (bench/options.py), the output.
- `add_output_args` / `emit` / `Report`: `--perf-file FILE` writes the output there too (atomically), after the
  command that made it, so a docs/perf file says how to make it again; `Report` prints as the bench goes.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

from bench.options import add_model_args
from megatron_ds.files import write_atomic


def _barrier():
    dist = sys.modules.get("torch.distributed")  # a bench's ranks have it; the parent process may not
    if dist is not None and dist.is_initialized():
        dist.barrier()


def alternated(runs: dict, iterations: int, start: int = 0, swap: bool = True, prepare=None, timer=None) -> dict:
    """{name: [seconds]}: `runs[name](x)` for each name, every iteration, after a barrier (the ranks start
    together), the order reversed every other iteration when `swap`. x is the step (start + iteration), or what
    `prepare(name, step)` makes of it off the clock (the step's batches, a trace switched on). `timer(fn)`:
    the seconds of fn() (default the wall clock; a `Timer` for a CUDA device)."""
    names, times, timer = list(runs), {name: [] for name in runs}, timer or Timer()
    for it in range(iterations):
        for name in (names[::-1] if swap and it % 2 else names):
            x = prepare(name, start + it) if prepare else start + it
            _barrier()
            times[name].append(timer(lambda: runs[name](x)))
    return times


class Timer:
    """Seconds of a region on `device`: CUDA events around it (synchronised), else the wall clock."""

    def __init__(self, device=None):
        self.cuda = device is not None and device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            import torch  # lazy: the CPU benches and `python -m bench` need no torch here
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def paired_ratio(numerator: list, denominator: list) -> float:
    """The median of numerator[i] / denominator[i]: neighbouring iterations paired, so slow drifts cancel."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def medians(times: dict, warmup: int = 0) -> dict:
    """{name: the median of its times after the first `warmup`}."""
    return {name: statistics.median(t[warmup:]) for name, t in times.items()}


def best_of(fn, repeat: int, setup=None, clocks=(time.perf_counter,)) -> tuple:
    """(the fewest seconds of `repeat` calls by each of `clocks`, ..., the last call's result): fn(), or
    fn(setup()) with `setup` run off the clock before each call (a fresh tokenizer, an empty cache)."""
    best, out = [float("inf")] * len(clocks), None
    for _ in range(max(1, repeat)):
        x = setup() if setup else None
        begin = [clock() for clock in clocks]
        out = fn(x) if setup else fn()
        best = [min(b, clock() - t) for b, clock, t in zip(best, clocks, begin)]
    return (*best, out)


def rounds(cells: list, count: int):
    """(round, cell) for `count` rounds over `cells`, every other round in reverse order."""
    for rnd in range(count):
        for cell in (cells if rnd % 2 == 0 else cells[::-1]):
            yield rnd, cell


class Machine:
    """The load average and the cores at the start (construction) and now."""

    def __init__(self):
        self.started, self.load = time.time(), os.getloadavg()
        self.cores = os.cpu_count()

    @staticmethod
    def _three(load) -> str:
        return " ".join(f"{x:.2f}" for x in load)

    def at_start(self) -> str:
        """ "load average 1.00 2.00 3.00 at start" (1, 5 and 15 minutes)."""
        return f"load average {self._three(self.load)} at start"

    def at_end(self) -> str:
        """ "done in N s; load average ... at end"."""
        return f"done in {time.time() - self.started:.0f} s; load average {self._three(os.getloadavg())} at end"

    def before_after(self) -> str:
        """ "load average (1 min) A before, B after, on N cores"."""
        return (f"load average (1 min) {self.load[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {self.cores} "
                "cores")


def table(header: list, align: str, rows: list) -> list:
    """Markdown lines: `header` (column names), `align` one letter a column (l: left, r: right), `rows` (each a
    list of cell texts, or a ready line)."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return [row(header), rule] + [line if isinstance(line, str) else row(line) for line in rows]


def row(cells: list) -> str:
    """One markdown table row of cell texts (a bench printing its rows as they come)."""
    return f"| {' | '.join(map(str, cells))} |"


def parser(doc: str, **model_defaults) -> argparse.ArgumentParser:
    """The bench's parser: described by `doc`'s first line, the model flags of `model_defaults` (bench/options.py
    add_model_args) and --perf-file."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    return add_output_args(add_model_args(ap, **model_defaults))


def add_output_args(parser):
    parser.add_argument("--perf-file", default=None, metavar="FILE",
                        help="also write the output to FILE (e.g. docs/perf/NAME.md), after the command that made it")
    return parser


def command(module: str, argv=None) -> str:
    """The command line that runs bench `module` with `argv` (default: this process's arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *map(shlex.quote, argv)])


def emit(text: str, perf_file: str | None, module: str, argv=None, printed_before: str = "") -> str:
    """Print `text`; with `perf_file`, write it there too, after the command that made it and what the bench
    printed before (`printed_before`: its header, printed at the start)."""
    print(text)
    if perf_file:
        write_atomic(perf_file, f"Made by `{command(module, argv)}`:\n\n{printed_before}{text}\n")
    return text


class Report:
    """A bench's output: each call prints its lines as the bench goes (flushed) and keeps them; `save()` writes
    them all to `perf_file`, after the command that made it (`module`, `argv`), when there is one."""

    def __init__(self, perf_file: str | None, module: str, argv=None):
        self.perf_file, self.module, self.argv, self.lines = perf_file, module, argv, []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def save(self) -> str:
        text = "\n".join(self.lines)
        if self.perf_file:
            write_atomic(self.perf_file, f"Made by `{command(self.module, self.argv)}`:\n\n{text}\n")
        return text
