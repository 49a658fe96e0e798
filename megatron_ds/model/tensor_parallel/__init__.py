"""Megatron-style tensor parallelism (after Megatron-LM's core/tensor_parallel).

state: the process groups (the mpu); checks: start-up layout checks; comm: the collectives
and their counter; mappings: autograd pairs of collectives between regions; layers: the
column/row-parallel linears and the vocab-parallel embedding; cross_entropy: the loss on
vocab-parallel logits; rng: dropout seeds per region.
"""
from megatron_ds.parallel_layout import ParallelConfigError, check_model_split, check_parallel_layout
from .comm import CommCounter
from .cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_loss
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_parallel_linear,
                     gather_full, mark_parallel, shard, unshard)
from .mappings import (copy_to_region, gather_from_region, gather_from_sequence, reduce_from_region,
                       reduce_scatter_to_sequence, scatter_to_region, scatter_to_sequence)
from .rng import Dropout, get_rng_tracker, model_parallel_manual_seed
from .state import (ParallelState, ensure_model_parallel, get_parallel_state, initialize_model_parallel,
                    tensor_parallel_group)
