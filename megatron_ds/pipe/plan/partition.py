"""Layer partitions balanced by cost: "pipeline.partition_method" = "flops" or "costs:..." (torch-free).

DeepSpeed's PipelineModule balances layer counts ("uniform", "type:REGEX") or parameter
counts ("parameters"). Neither sees that the LM head of a 50k vocabulary costs as much as
several transformer layers while holding no more parameters than the embedding, which costs
almost nothing. The two methods here weigh each layer of the GPT's list [Embedding,
TransformerLayer x L, FinalNorm, LM head] by a cost:

- "flops": forward FLOPs per token from the model's sizes (`layer_flops`; GQA and SwiGLU
  aware, causal attention over the whole sequence, the head's 2 h V);
- "costs:[c0, c1, ...]" (one number per layer of that list, e.g. milliseconds of F+B+W
  measured by bench/layer_costs.py --costs-out) or "costs:FILE.json" (that list, or an
  object whose "layer_costs" is that list).

The cut minimises the busiest pipeline RANK, not stage: a rank's load is the sum of the
virtual stages the schedule places on it, so under the V placements (zbv, dualpipev), where
rank 0 holds both the first and the last stage, the embedding and head stages hold fewer
transformer layers and rank 0 fewer in total. Ties go to the cut with the lighter busiest
stage. Every stage keeps at least one layer; a stage may hold no transformer layer (e.g.
only the final norm and the head) when that balances best. Under vocabulary parallelism the head
leaves the list (every rank holds a slice of it beside its stages): the same costs are given, and
the head's is dropped.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from megatron_ds.files import UnreadableFile, read_json
from megatron_ds.schedules.flops import layer_shapes, span_flops, vocab_size

from .config import ConfigError
from .layout import PREFIX as LAYOUT_PREFIX, LayoutError, is_layout, layout_bounds

COSTS_PREFIX = "costs:"
FLOPS = "flops"


def is_cost_method(method: str) -> bool:
    """Whether this package cuts the layers (by costs, or as a written layout: pipe/plan/layout.py), not DeepSpeed."""
    return method == FLOPS or method.startswith(COSTS_PREFIX) or is_layout(method)


def gpt_layer_count(num_layers: int) -> int:
    """Layers of the pipelined GPT's list: embedding, the transformer layers, final norm, head."""
    return num_layers + 3


def layer_flops(config) -> list[float]:
    """Forward FLOPs per token of each pipeline layer of a GPT of `config`'s sizes.

    A transformer layer: schedules/flops.span_flops over the whole sequence, per token (MoE, GQA and
    SwiGLU aware; causal attention 2 s h per token on average). The head: 2 h V plus the softmax
    cross-entropy (about 5 V). The embedding is a lookup and the norms are elementwise: a few h
    each, so their cost is left to measured costs."""
    h, s = config.hidden_size, config.max_position_embeddings
    layers = [float(span_flops(0, s, **shape) / s) for shape in layer_shapes(config)]
    vocab = vocab_size(config)
    embed = 2 * h if getattr(config, "embed_layernorm", False) else h
    return [float(embed)] + layers + [5.0 * h, 2.0 * h * vocab + 5.0 * vocab]


def _read_costs(spec: str, where: str) -> list:
    text = spec[len(COSTS_PREFIX):].strip()
    if not text.startswith("["):
        if not os.path.isfile(text):
            raise ConfigError(f'{where}: no file {text!r}; give "costs:[c0, c1, ...]" or "costs:FILE.json"')
        try:
            data = read_json(text, f"{where}: {text!r}")
        except UnreadableFile as exc:
            raise ConfigError(str(exc)) from None
        return data.get("layer_costs") if isinstance(data, dict) else data
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: the list is not JSON ({exc})") from None


def layer_costs(method: str, config, num_specs: int, vocab_parallel: bool = False) -> list[float]:
    """One cost per pipeline layer under a cost method; refuses a list of the wrong length. Under
    `vocab_parallel` the list's last cost, the head's, is dropped (num_specs counts it)."""
    where = f'ds_config "pipeline.partition_method" = {method!r}'
    costs = layer_flops(config) if method == FLOPS else _read_costs(method, where)
    if not isinstance(costs, list) or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                              and c >= 0 for c in costs):
        raise ConfigError(f"{where}: the costs must be a list of numbers >= 0, one per pipeline layer")
    if len(costs) != num_specs:
        raise ConfigError(f"{where}: {len(costs)} costs for {num_specs} pipeline layers (embedding, "
                          f"{num_specs - 3} transformer layers, final norm, head); give one per layer")
    costs = costs[:-1] if vocab_parallel else costs
    if not sum(costs) > 0:
        raise ConfigError(f"{where}: the costs sum to 0; nothing to balance")
    return [float(c) for c in costs]


def _stage_loads(weights, bounds):
    return [sum(weights[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def _linear_bounds(weights: Sequence[float], stages: int) -> list[int]:
    """Bounds of `stages` non-empty contiguous parts whose heaviest part is as light as can be."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cut(limit):  # greedy: each part as long as fits, leaving one layer for every later part
        bounds = [0]
        for s in range(stages - 1):
            end = bounds[-1] + 1
            while end < n - (stages - 1 - s) and prefix[end + 1] - prefix[bounds[-1]] <= limit:
                end += 1
            bounds.append(end)
        bounds.append(n)
        return bounds

    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the least limit whose greedy cut keeps every part under it
        mid = (lo + hi) // 2
        if max(_stage_loads(weights, cut(candidates[mid]))) <= candidates[mid]:
            hi = mid
        else:
            lo = mid + 1
    return cut(candidates[lo])


def _descending(xs):
    return tuple(sorted((round(x, 9) for x in xs), reverse=True))


def balanced_bounds(weights: Sequence[float], placement: Sequence[Sequence[int]]) -> list[int]:
    """Stage bounds (len = stages + 1) minimising the sorted per-rank loads, then per-stage ones.

    Start from the cut that balances stages, then take the best move while one lightens the
    busiest rank (ties: the next busiest, then the stages). A move shifts bounds i..j by one
    layer: stage i-1 hands a layer to stage j, or takes one, through the stages between (which
    keep their counts), so a layer can travel between two stages of one rank, or of two
    far-apart ranks, in one move. One stage per rank is optimal at the start."""
    stages = len(placement[0])
    total = sum(weights)
    weights = [w * len(weights) / total for w in weights]  # mean 1: the rounding in _descending is relative
    ranks = 1 + max(max(row) for row in placement)
    bounds = _linear_bounds(weights, stages)

    def score(b):
        stage = _stage_loads(weights, b)
        load = [0.0] * ranks  # with two replicas (bitpipe) a rank's load is the sum of both
        for row in placement:
            for s, r in enumerate(row):
                load[r] += stage[s]
        return _descending(load), _descending(stage)

    best = score(bounds)
    while True:
        moves = []
        for i in range(1, stages):
            for j in range(i, stages):
                for step in (-1, 1):
                    b = bounds[:i] + [x + step for x in bounds[i:j + 1]] + bounds[j + 1:]
                    if b[i - 1] < b[i] and b[j] < b[j + 1]:
                        moves.append((score(b), b))
        if not moves:
            return bounds
        top = min(moves)
        if top[0] >= best:
            return bounds
        best, bounds = top


def cost_bounds(method: str, config, placement: Sequence[Sequence[int]], num_specs: int | None = None,
                vocab_parallel: bool = False) -> list[int]:
    """The layer bounds of each virtual stage of replica 0's order under a cost method (`vocab_parallel`:
    of the list without the head)."""
    stages = len(placement[0])
    if is_layout(method):
        try:
            return layout_bounds(method[len(LAYOUT_PREFIX):], config.num_layers, stages, vocab_parallel)
        except LayoutError as exc:
            raise ConfigError(f'ds_config "pipeline.partition_method": {exc}') from None
    num_specs = gpt_layer_count(config.num_layers) if num_specs is None else num_specs
    weights = layer_costs(method, config, num_specs, vocab_parallel)
    if stages > len(weights):
        raise ConfigError(f'ds_config "pipeline.partition_method" = {method!r}: {stages} virtual stages but only '
                          f"{len(weights)} pipeline layers; every stage needs at least one")
    return balanced_bounds(weights, placement)


def chunk_cost_bounds(method: str, config, placement: Sequence[Sequence[int]],
                      vocab_parallel: bool = False) -> list[int] | None:
    """The virtual stages' layer bounds under a cost method; None: DeepSpeed's method cuts them when the
    module is built. Not part of the PipelinePlan: "flops" weighs the head by the vocabulary the
    tokenizer pads, known only at build time (parse time checks the cut with the unpadded one)."""
    return cost_bounds(method, config, placement, vocab_parallel=vocab_parallel) if is_cost_method(method) else None


def stock_cost_bounds(config, settings, pp: int) -> list[int]:
    """The cost cut for DeepSpeed's own engine: one stage per rank, in rank order."""
    return cost_bounds(settings.partition_method, config, [list(range(pp))])
