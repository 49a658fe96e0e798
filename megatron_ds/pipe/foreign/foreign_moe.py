"""Mixtures of experts in a user's own PipelineModule (megatron_ds.initialize).

Our TransformerLayer built with a GPTConfig whose `moe` is set holds the MoE MLP; the engine takes its router
losses and expert bias update as for our GPT (pipe/moe/moe.py's RouterStep, which initialize_engine adds to any
module with routers). With expert parallelism (`expert_model_parallel_size` EP > 1) two things differ:

- The EP groups must exist before the layers are built: an MoE layer keeps only its EP rank's experts (every
  expert is drawn, in order, so the weights do not depend on EP). A user's PipelineModule builds its layers when
  constructed, before megatron_ds.initialize, so the user makes the groups first (`expert_parallel_groups`),
  from the topology the PipelineModule will have: EP consecutive ranks of the data axis (DP x CP under context
  parallelism, so EP 2 at CP 2 shares the experts out over the CP pair), as for our GPT. initialize checks that
  the registered groups are those of the module's topology.
- DeepSpeed's ZeRO reduces and shards the expert parameters over their expert-data-parallel group, and asks for
  them in optimizer groups of their own ("moe": True): initialize splits the user's groups so (`expert_groups`;
  each group's settings kept), whether they come as model_parameters, an optimizer or the module's parameters
  for the ds_config's optimizer.
"""
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from megatron_ds.model.moe import MoE
from megatron_ds.model.moe_dispatch import group_name

from ..deepspeed import ds_internals as ds
from ..moe.moe import ensure_expert_parallel, optimizer_param_groups
from ..plan.config import ConfigError


def expert_parallel_groups(config, num_stages: int = 1, topology=None) -> None:
    """Make the expert-parallel groups of `config`'s MoE layers (a GPTConfig; nothing without expert parallelism):
    call it on every rank before building the PipelineModule, with its `num_stages` (or the `topology` you give
    it). A collective."""
    if topology is None:
        world = dist.get_world_size()
        if world % num_stages:
            raise ConfigError(f"num_stages {num_stages} must divide the world size {world}")
        topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
    ensure_expert_parallel(config, topology)


def check_experts(module, topology) -> None:
    """Every expert-parallel MoE layer of the rebuilt chunks has the EP group the module's topology gives it (EP
    consecutive data-axis ranks); the ranks exchange what they found, so every rank refuses alike."""
    sizes = sorted({m.config.expert_model_parallel_size for m in module.modules()
                    if isinstance(m, MoE) and m.ep_group is not None})
    mine = ""
    for ep in sizes:
        _, ranks, _, _ = ds.expert_parallel_registries()
        lane = next(lane for lane in topology.get_axis_comm_lists("data") if dist.get_rank() in lane)
        at = lane.index(dist.get_rank()) // ep * ep
        if list(ranks[group_name(ep)]) != lane[at:at + ep]:
            mine = (f"expert parallelism {ep}: rank {dist.get_rank()}'s EP group is ranks "
                    f"{list(ranks[group_name(ep)])}, and the PipelineModule's topology gives it {lane[at:at + ep]}; "
                    "make the groups with megatron_ds.pipe.foreign.foreign_moe.expert_parallel_groups(config, "
                    "num_stages) before building the module")
            break
    found = [mine]
    if dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    problems = [p for p in found if p]
    if problems:
        raise ConfigError(problems[0])


def expert_groups(groups: list) -> list:
    """Param groups (dicts) with the expert-parallel parameters moved to groups of their own, as DeepSpeed's ZeRO
    reads them; unchanged without any. A group without a "name" is named by its place."""
    if not any(is_moe_param(p) for g in groups for p in g["params"]):
        return groups
    named = [{**g, "name": g.get("name", f"group_{i}"), "params": list(g["params"])} for i, g in enumerate(groups)]
    if len({g["name"] for g in named}) < len(named):
        raise ConfigError(f"parameter groups named {[g['name'] for g in named]}: with expert parallelism each group "
                          "needs a name of its own (DeepSpeed splits each group's experts into one named after it)")
    return optimizer_param_groups(named)


def module_groups(module) -> list:
    """The module's trainable parameters as one param group, its experts split off (the ds_config's optimizer)."""
    return expert_groups([{"params": [p for p in module.parameters() if p.requires_grad]}])


def has_experts(module) -> bool:
    return any(is_moe_param(p) for p in module.parameters())
