"""A PipelineModule cut into a schedule's virtual stages ("chunks").

DeepSpeed's PipelineModule gives each rank one contiguous slice of layers. Here
the layers are partitioned into the schedule's S virtual stages and each rank
builds the chunks the schedule places on it (several for interleaved and V
schedules). One chunk at a time is exposed to PipelineModule.forward, so
activation checkpointing, tied layers and layer checkpoint files (named by
global layer index) work per chunk exactly as DeepSpeed does them.
"""
import contextlib

from deepspeed.pipe import PipelineModule

from .deepspeed import ds_internals as ds
from .plan.config import ConfigError
from .plan.recompute import chunk_groups, forward_in_groups, interval
from .replicas import ReplicaSync
from .vocab.vocab_checkpoint import gather_whole, load_slice, save_head, with_whole_embedding, without_whole_embedding


def given_parts(module, parts, method):
    """`parts` as the module's layer bounds, once they are known to cover its layer list."""
    if parts[-1] != len(ds.layer_specs(module)):
        raise ConfigError(f"partition_method {method!r} cut {parts[-1]} pipeline layers, but the model has "
                          f"{len(ds.layer_specs(module))}: the cost methods need the GPT's layer list")
    return list(parts)


class CostPartitionedPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule (the stock engine's) with its stages cut by a cost method."""

    def __init__(self, layers, parts, **kwargs):
        self.given_parts = parts
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method="uniform"):
        self.parts = given_parts(self, self.given_parts, method)
        ds.set_bounds(self, start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])


class ChunkedPipelineModule(PipelineModule):

    def __init__(self, layers, plan, parts=None, recompute=None, **kwargs):
        """`plan` (a PipelinePlan) places the chunks: placement[replica][stage] -> pipeline rank.
        `parts`: the layer bounds of the virtual stages under a cost partition method
        (partition.chunk_cost_bounds; None: DeepSpeed's method cuts them). `recompute`: Megatron's whole-layer
        recompute (schedules/recompute.Recompute, granularity "full"), run per chunk (pipe/plan/recompute.py)."""
        self.plan, self.given_parts = plan, parts
        self.recompute = recompute if recompute is not None and recompute.full else None
        if self.recompute:
            kwargs["activation_checkpoint_interval"] = interval(self.recompute,
                                                                kwargs.get("activation_checkpoint_interval", 0))
        self.placement = [list(row) for row in plan.placement]
        super().__init__(layers, **kwargs)
        self.replica_sync = None
        if len(self.placement) > 1:
            self.replica_sync = ReplicaSync(self, ds.grid(self))
            self.replica_sync.broadcast_weights()

    @property
    def num_virtual_stages(self):
        return len(self.placement[0])

    def _partition_layers(self, method="uniform"):
        if self.given_parts is not None:  # a cost method cut them (pipe/plan/partition.py)
            self.parts = given_parts(self, self.given_parts, method)
        else:
            # The parent cuts the layers into num_stages parts: make that the virtual-stage count
            # for the call, then give num_stages back its DeepSpeed meaning (the pipeline size).
            pp, self.num_stages = self.num_stages, self.num_virtual_stages
            try:
                super()._partition_layers(method)
            finally:
                self.num_stages = pp
            self.parts = [int(b) for b in self.parts]  # DeepSpeed returns numpy ints
        empty = [s for s in range(self.num_virtual_stages) if self.parts[s] == self.parts[s + 1]]
        if empty:
            raise ConfigError(f"partition_method {method!r} leaves virtual stage(s) {empty} without layers "
                              f"(bounds {self.parts}); use more layers or fewer stages")
        self.chunks = sorted((rep, st) for rep, row in enumerate(self.placement)
                             for st, rank in enumerate(row) if rank == self.stage_id)
        self.chunk_bounds = {c: (self.parts[c[1]], self.parts[c[1] + 1]) for c in self.chunks}

    def stage_owner(self, layer_idx):
        """The pipeline rank holding layer_idx (replica 0), for DeepSpeed's tied-weight groups."""
        for stage in range(self.num_virtual_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return self.placement[0][stage]
        raise ValueError(f"layer {layer_idx} is outside the partition {self.parts}")

    def _build(self):
        self.chunk_funcs, self.chunk_checkpointable, self.chunk_groups = {}, {}, {}
        for chunk in self.chunks:
            ds.set_bounds(self, *self.chunk_bounds[chunk])
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs[chunk] = self.forward_funcs
            if self.recompute:  # Megatron's groups, in place of DeepSpeed's interval (pipe/plan/recompute.py)
                self.chunk_groups[chunk] = chunk_groups(self.recompute, self.forward_funcs)
        self.activate(self.chunks[0])

    def activate(self, chunk):
        """Expose `chunk`'s layers as this module's forward pass."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        ds.set_bounds(self, *self.chunk_bounds[chunk])
        self.is_checkpointable_results = self.chunk_checkpointable.get(chunk, [])

    def _precompute_checkpointable_values(self):
        for chunk in self.chunks:
            self.activate(chunk)
            self.is_checkpointable_results_interval = None  # the parent's cache is per chunk here
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results

    def chunk_forward(self, chunk, inputs):
        self.activate(chunk)
        if chunk in self.chunk_groups:
            return forward_in_groups(self, self.chunk_groups[chunk], inputs)
        return super().forward(inputs)

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        # vocabulary parallelism: the files hold the whole matrices, which their writers gather
        whole = gather_whole(self) if getattr(self, "vocab_slice", None) is not None else {}
        for chunk in self.chunks:
            if chunk[0] == 0:  # a checkpoint holds one copy of each layer
                self.activate(chunk)
                saving = (with_whole_embedding(self.forward_funcs[0], whole["wte"])
                          if whole.get("wte") is not None and ds.local_start(self) == 0 else contextlib.nullcontext())
                with saving:
                    super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
                if whole.get("head") is not None and ds.local_stop(self) == len(ds.layer_specs(self)):
                    save_head(self, save_dir, checkpoint_engine, whole["head"])

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        # The parent re-broadcasts tied weights after loading: a collective, so do it
        # once here rather than once per chunk.
        vocab = getattr(self, "vocab_slice", None)
        with ds.tied_weight_sync_put_off(self):
            for chunk in self.chunks:
                self.activate(chunk)
                loading = (without_whole_embedding(self.forward_funcs[0]) if vocab is not None
                           and ds.local_start(self) == 0 else contextlib.nullcontext())
                with loading:
                    super().load_state_dir(load_dir, checkpoint_engine, strict)
        if vocab is not None:
            load_slice(self, load_dir)
        if self.replica_sync:
            self.replica_sync.broadcast_weights()
