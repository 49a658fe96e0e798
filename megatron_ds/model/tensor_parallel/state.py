"""Which ranks share a tensor-, pipeline- or data-parallel group: the mpu DeepSpeed's engine asks.

The layout is DeepSpeed's PipeModelDataParallelTopology(num_pp, num_mp, num_dp): axes
(pipe, data, model), model fastest, so a tensor-parallel group is consecutive ranks as
in Megatron, and data-parallel peers are TP ranks apart. `get_model_parallel_*` means
what it means in DeepSpeed's PipelineParallelGrid: all ranks holding a piece of one
model replica (pipe x tensor), the group DeepSpeed sums gradient norms and overflow
flags over; `get_tensor_model_parallel_*` is the tensor-parallel group alone.
"""
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron_ds.parallel_layout import data_parallel_size


class ParallelState:

    def __init__(self, pipeline_parallel=1, tensor_parallel=1):
        """Collective: every rank of the default group must build it, with the same sizes."""
        self.topology = PipeModelDataParallelTopology(
            num_pp=pipeline_parallel, num_mp=tensor_parallel,
            num_dp=data_parallel_size(dist.get_world_size(), pipeline_parallel, tensor_parallel))
        self.global_rank = dist.get_rank()
        self.coord = self.topology.get_coord(self.global_rank)
        axis_lists = {axis: self.topology.get_axis_comm_lists(axis) for axis in ("pipe", "data", "model")}
        axis_lists["replica"] = [sorted(self.topology.filter_match(data=d))
                                 for d in range(self.topology.get_dim("data"))]
        self.ranks, self.groups = {}, {}
        for name, lists in axis_lists.items():
            for ranks in lists:  # every rank creates every group, in the same order
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    self.ranks[name], self.groups[name] = ranks, group

    def _rank_in(self, name):
        return self.ranks[name].index(self.global_rank)

    # tensor parallelism
    def get_tensor_model_parallel_group(self):
        return self.groups["model"]

    def get_tensor_model_parallel_world_size(self):
        return len(self.ranks["model"])

    def get_tensor_model_parallel_rank(self):
        return self.coord.model

    def get_tensor_model_parallel_src_rank(self):
        return self.ranks["model"][0]

    def tensor_parallel_group_or_none(self):
        """The group the parallel layers take: None (no communication) without tensor parallelism."""
        return self.groups["model"] if len(self.ranks["model"]) > 1 else None

    # pipeline parallelism
    def get_pipe_parallel_group(self):
        return self.groups["pipe"]

    def get_pipe_parallel_world_size(self):
        return len(self.ranks["pipe"])

    def get_pipe_parallel_rank(self):
        return self.coord.pipe

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    # data parallelism
    def get_data_parallel_group(self):
        return self.groups["data"]

    def get_data_parallel_world_size(self):
        return len(self.ranks["data"])

    def get_data_parallel_rank(self):
        return self.coord.data

    # one model replica: pipeline x tensor (DeepSpeed's "model parallel")
    def get_model_parallel_group(self):
        return self.groups["replica"]

    def get_model_parallel_world_size(self):
        return len(self.ranks["replica"])

    def get_model_parallel_rank(self):
        return self._rank_in("replica")


_STATE = None


def initialize_model_parallel(pipeline_parallel=1, tensor_parallel=1):
    global _STATE
    _STATE = ParallelState(pipeline_parallel, tensor_parallel)
    return _STATE


def ensure_model_parallel(pipeline_parallel, tensor_parallel):
    """The current state if it has these sizes, else a new one (collective)."""
    if _STATE is None or (_STATE.get_pipe_parallel_world_size(), _STATE.get_tensor_model_parallel_world_size()) \
            != (pipeline_parallel, tensor_parallel):
        initialize_model_parallel(pipeline_parallel, tensor_parallel)
    return _STATE


def get_parallel_state():
    if _STATE is None:
        raise RuntimeError("model parallelism is not initialised (call initialize_model_parallel)")
    return _STATE


def tensor_parallel_group(config):
    """The group a model's layers split over: None (no communication) when config asks for no TP."""
    tp = config.tensor_model_parallel_size
    if tp == 1:
        return None
    state = get_parallel_state()
    if state.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(f"the model asks for tensor parallelism {tp}, the process groups have "
                           f"{state.get_tensor_model_parallel_world_size()}")
    return state.get_tensor_model_parallel_group()
