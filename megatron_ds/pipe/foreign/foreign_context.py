"""Context parallelism for a user's own PipelineModule (megatron_ds.initialize).

The ds_config's "context_parallel" section (the GPT's: {"context_parallel_size": C, "cp_comm_type": ...}) splits
each sequence over C ranks as for our GPT (pipe/parallel/context_parallel.py): the data axis of the module's
topology is DP x C, CP inner, and every CP rank of a replica is handed the replica's whole micro-batch. The
engine cuts every tensor of a micro-batch's inputs and labels along dim 1 to the rank's two chunks
(ContextLayout.shard), so a stage sees (b, s / C, ...) and the loss function the rank's labels.

The loss: DeepSpeed averages the ranks' losses and gradients over DP x C. A loss that is the mean over its
rank's tokens is then the true mean when every rank scores as many tokens (every label scored: each rank holds
s / C of every sequence). megatron_ds.model.gpt_loss as the module's loss_fn is exact with ignored labels too
(-100, not scored): it is given (labels, the micro-batch's scored tokens / C), as our GPT's loss is.

Attention must be megatron_ds.model's (CausalSelfAttention, in a TransformerLayer or alone, its GPTConfig's
context_parallel_size C): it alone exchanges keys and values over the CP group and rotates by global positions;
any other would silently attend within its rank's shard. Refused here, one line each: a section that is not
the flags' values, C with DeepSpeed's own engine or with `training_data` (its loader gives each data-axis rank
other samples), a layer whose attention is not ours (torch's MultiheadAttention, a class named *Attention from
elsewhere), no attention of ours at all, ours built for another C or comm type, and a tensor whose dim 1 does
not split into 2 x C chunks. Every other layer must act per token (norms, MLPs, embeddings, the head).
"""
import torch
import torch.distributed as dist

from megatron_ds.cp_section import SECTION, section_of, section_problem
from megatron_ds.model import gpt_loss
from megatron_ds.model.attention import CausalSelfAttention
from megatron_ds.model.context_parallel import layout_problem

from ..plan.config import ConfigError

def context_settings(ds_config: dict) -> tuple[int, str | None]:
    """(C, the comm type the section names or None) of the ds_config's "context_parallel" section (its shape
    checked as the flags' is: cp_section.py)."""
    problem = section_problem(ds_config)
    if problem:
        raise ConfigError(problem)
    section = section_of(ds_config)
    size, comm = section.get("context_parallel_size", 1), section.get("cp_comm_type")
    if comm == "a2a+p2p" and size > 1:  # its inner and outer groups are made for our GPT's flags alone
        raise ConfigError(f'ds_config "{SECTION}.cp_comm_type" = "a2a+p2p" with your own PipelineModule: not run '
                          "yet; use p2p, allgather or a2a")
    return size, comm


def check_run(size: int, stock: bool, training_data) -> None:
    """What runs under context parallelism: a named schedule, batches the user hands to train_batch."""
    if size == 1:
        return
    if stock:
        raise ConfigError(f'ds_config "{SECTION}.context_parallel_size" = {size} with your own PipelineModule runs '
                          'under a named schedule ("pipeline": {"schedule": ...}); DeepSpeed\'s own engine would '
                          "give each rank its whole sequence")
    if training_data is not None:
        raise ConfigError(f'ds_config "{SECTION}.context_parallel_size" = {size}: DeepSpeed\'s loader of '
                          "training_data gives every data-axis rank other samples, and the CP ranks of a replica "
                          "read the same ones; pass train_batch an iterator of the replica's micro-batches (replica: "
                          f"engine.grid.get_data_parallel_rank() // {size})")


def _foreign_attention(module) -> bool:
    if isinstance(module, torch.nn.MultiheadAttention):
        return True
    name = type(module).__name__
    return name.endswith("Attention") and not type(module).__module__.startswith("megatron_ds.")


def check_layers(module, size: int, comm: str | None) -> None:
    """The built layers attend through our attention, made for C ranks (and the section's comm type). Each rank
    sees its own chunks: the ranks exchange what they found (a collective), so every rank refuses alike."""
    if size == 1:
        return
    mine = _layer_problem(module, size, comm)
    found = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    problems = [problem for problem, _ in found if problem]
    if problems:
        raise ConfigError(problems[0])
    if not any(ours for _, ours in found):
        raise ConfigError(f'ds_config "{SECTION}.context_parallel_size" = {size}, and no layer holds '
                          "megatron_ds.model's attention (CausalSelfAttention): the sequence is split over the CP "
                          "ranks, and only that attention attends across them")


def _layer_problem(module, size, comm):
    """(what is wrong with this rank's layers or '', whether they hold our attention)."""
    ours = False
    for name, sub in module.named_modules():
        where = f"layer {name.split('.', 1)[0]} ({name}: {type(sub).__name__})" if name else type(sub).__name__
        if isinstance(sub, CausalSelfAttention):
            ours = True
            if sub.context_parallel_size != size or (comm is not None and sub.cp_comm_type != comm):
                return (f"{where} was built with context_parallel_size {sub.context_parallel_size}, cp_comm_type "
                        f"{sub.cp_comm_type!r}; ds_config \"{SECTION}\" says {size}" + (f", {comm!r}" if comm else "")
                        + ": give its GPTConfig the same"), ours
        elif _foreign_attention(sub):
            return (f"{where} under context parallelism {size} would attend only its rank's 1/{size} of the "
                    "sequence; attend through megatron_ds.model's CausalSelfAttention (a TransformerLayer), which "
                    "exchanges keys and values over the CP ranks"), ours
    return "", ours


def shard(layout, part, what: str):
    """A batch part (a tensor, or a tuple/list of them; anything else as given) cut along dim 1 to this rank's
    tokens."""
    if torch.is_tensor(part):
        problem = layout_problem(part.shape[1], layout.size, f"dim 1 of a micro-batch's {what} tensor") if part.dim() > 1 \
            else f"a micro-batch's {what} tensor of shape {tuple(part.shape)} has no dim 1 (the sequence) to cut"
        if problem:
            raise ConfigError(f"context parallelism {layout.size}: {problem}")
        return layout.shard(part, 1)
    if isinstance(part, (tuple, list)):
        return tuple(shard(layout, t, what) for t in part)
    return part


def local_batch(layout, loss_fn, inputs, labels):
    """(inputs, labels) as this CP rank's stages and loss see them; gpt_loss's labels with their divisor."""
    scored = float((labels >= 0).sum()) if loss_fn is gpt_loss and torch.is_tensor(labels) else None
    inputs, labels = shard(layout, inputs, "input"), shard(layout, labels, "label")
    return inputs, labels if scored is None else (labels, torch.tensor(scored / layout.size))
