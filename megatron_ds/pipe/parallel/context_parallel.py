"""Context parallelism in the pipeline engines: the runtime's side (model/context_parallel/ is the layers').

Ranks: the topology's "data" axis is DP x CP with the CP ranks inner (Megatron's tp-cp-dp-pp order: global rank =
tp + TP x (cp + CP x (dp + DP x pp))); a CP group is CP consecutive data-axis ranks of one (stage, replica, tensor
rank). Under --cp-comm-type a2a+p2p each CP group is cut into its two levels too (`levels`: Megatron-core's
order, the all-to-all over A consecutive CP ranks, the ring over the ranks at one position of those groups).
DeepSpeed's gradient all-reduce and ZeRO-1 partitions go over the whole axis, as MoE's expert-parallel
groups are drawn from it (pipe/moe/moe.py); the samples a rank reads are its replica's, data-axis rank // CP (training/loop.py).

Data and loss: every CP rank reads its replica's whole micro-batch (the packed documents are built of the whole
sequence); each op's tokens, position ids and labels are the rank's shard of them (its Seq1F1B segment's, cut on
its own: ContextLayout.shard). A rank's loss is the sum of its tokens' losses over the micro-batch's scored tokens
/ CP: DeepSpeed's mean over DP x CP is then the true mean loss, and its gradient the true gradient.

ScheduleEngine cuts each op's tokens (engine.py: _inputs, _labels; the vocabulary passes' alike, vocab_passes.py);
DeepSpeed's own engine, which loads a whole
micro-batch per stage and learns its message shapes from the first one it sends, gets its micro-batches cut
already (context_parallel_engine), the loss's token count beside the labels.
"""
import functools

import torch
import torch.distributed as dist

from megatron_ds.model.context_parallel import ContextLayout, set_context_parallel_group

_GROUPS = {}  # (the data-axis lanes, CP) -> this rank's CP group: made once per process


def ensure_context_parallel(config, topology) -> ContextLayout | None:
    """Register this rank's CP group for `config`'s attention (collective: every rank makes every group, in the
    same order) and return its layout; None (and nothing registered) without context parallelism."""
    cp = getattr(config, "context_parallel_size", 1)
    if cp == 1:
        set_context_parallel_group(None, 1)
        return None
    lanes = topology.get_axis_comm_lists("data")  # each ordered by data-axis coordinate
    if any(len(lane) % cp for lane in lanes):
        raise ValueError(f"--context-parallel-size {cp} must divide the topology's data axis "
                         f"({len(lanes[0])} ranks = data-parallel x context-parallel)")
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None) \
        if getattr(config, "cp_comm_type", "p2p") == "a2a+p2p" else None
    key = (tuple(map(tuple, lanes)), cp, sizes)
    if key not in _GROUPS:
        me = dist.get_rank()
        for lane in lanes:
            for start in range(0, len(lane), cp):
                ranks = lane[start:start + cp]
                group = dist.new_group(ranks=ranks)
                subgroups = [(sub, dist.new_group(ranks=sub)) for sub in levels(ranks, sizes)]
                if me in ranks:  # its inner group, then its outer one
                    _GROUPS[key] = group, tuple(g for sub, g in subgroups if me in sub)
    group, inner_outer = _GROUPS[key]
    set_context_parallel_group(group, cp, inner_outer or None, sizes)
    return ContextLayout.of(group)


def levels(ranks, sizes) -> list[list[int]]:
    """a2a+p2p's inner groups (A consecutive ranks of the CP group `ranks`), then its outer ones (the ranks at one
    position of their inner groups), as Megatron-core makes its hierarchical CP groups; [] without `sizes`."""
    if sizes is None:
        return []
    a = sizes[0]
    return [ranks[i:i + a] for i in range(0, len(ranks), a)] + [ranks[i::a] for i in range(a)]


def context_parallel_size(module) -> int:
    layout = getattr(module, "context_layout", None)
    return 1 if layout is None else layout.size


def deepspeed_batch(ds_config: dict, cp: int) -> dict:
    """The ds_config as DeepSpeed's engine counts it: its data-parallel world is the data axis, DP x CP, so its
    "train_batch_size" is the run's global batch (samples, Megatron's and Ulysses' count) x CP."""
    if cp == 1 or "train_batch_size" not in ds_config:
        return ds_config
    return {**ds_config, "train_batch_size": ds_config["train_batch_size"] * cp}


def samples_batch(deepspeed_config: dict, cp: int) -> dict:
    """deepspeed_batch undone: the ds_config in samples, from the one DeepSpeed's engine holds (engine.config),
    for a new engine built of it ("auto"'s switch)."""
    if cp == 1 or "train_batch_size" not in deepspeed_config:
        return deepspeed_config
    return {**deepspeed_config, "train_batch_size": deepspeed_config["train_batch_size"] // cp}


def local_inputs(layout, inputs: tuple) -> tuple:
    """This rank's tokens and position ids (the global positions of its tokens) of a (segment's) inputs."""
    return inputs if layout is None else tuple(layout.shard(t, 1) for t in inputs)


def local_labels(layout, labels, scored_tokens):
    """(this rank's labels, the token count its loss sum is divided by): the micro-batch's scored tokens / CP."""
    return layout.shard(labels, 1), scored_tokens / layout.size


class ShardedBatches:
    """Micro-batches ((tokens, position ids), labels) as DeepSpeed's own engine loads them under context
    parallelism: this rank's tokens, position ids and labels, and the divisor of its loss sum (the micro-batch's
    scored tokens / CP, a tensor, as the engine moves only tensors) beside the labels."""

    def __init__(self, batches, layout: ContextLayout):
        self.batches, self.layout = iter(batches), layout

    def __iter__(self):
        return self

    def __next__(self):
        inputs, labels = next(self.batches)
        scored = torch.tensor(float((labels >= 0).sum()))  # documents.IGNORE (< 0) is not scored
        return local_inputs(self.layout, inputs), local_labels(self.layout, labels, scored)


@functools.lru_cache(maxsize=None)
def context_parallel_engine(engine_class):
    """DeepSpeed's own engine class (or one of ours deriving from it) reading ShardedBatches of every iterator it
    is given (train_batch's, eval_batch's; an iterator already cut is kept)."""

    def set_dataiterator(self, iterator):
        if iterator is not None and not isinstance(iterator, ShardedBatches):
            iterator = ShardedBatches(iterator, self.module.context_layout)
        engine_class.set_dataiterator(self, iterator)

    return type(engine_class.__name__, (engine_class,),
                {"set_dataiterator": set_dataiterator, "__doc__": engine_class.__doc__})
