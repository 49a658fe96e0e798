"""Tensor-parallel flags and the (pipe, data, model) layout of the ranks.

The ranks are laid out as DeepSpeed's PipeModelDataParallelTopology: axes (pipe, data,
model), model fastest. Rank r is tensor rank r % TP, data rank (r // TP) % DP and
pipeline stage r // (TP x DP), with DP = world / (PP x TP).

The layout and the model split are checked at parse time (no torch, no process group),
so a bad combination is one line and exit code 2 before anything starts.
"""
from megatron_ds.parallel_layout import ParallelConfigError, check_parallel_layout
from megatron_ds.pipe.config import ConfigError, sequence_parallel_ds_config
from megatron_ds.pipe.segments import sequence_shards

from ..errors import ArgumentsError


def add_parallel_args(parser):
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="split heads, MLP and vocabulary over this many ranks (Megatron's tensor parallelism)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="also split the sequence outside attention and MLP over the tensor-parallel ranks "
                        "(Megatron's sequence parallelism; pipeline messages carry the shards)")


def check_parallel_args(args):
    """Check TP x PP against the world and the model split (arguments.py derives data_parallel_size)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # Without --pad-vocab-size-to the tokenizer pads to a multiple of make_vocab_size_divisible_by x TP,
    # which TP divides by construction; the size itself is known only once the tokenizer is loaded.
    try:
        check_parallel_layout(world_size=args.world_size, tensor_parallel=tp, pipeline_parallel=pp,
                              num_attention_heads=args.num_attention_heads,
                              ffn_hidden_size=args.gpt_config.ffn_hidden_size,
                              padded_vocab_size=args.pad_vocab_size_to, num_key_value_heads=args.num_key_value_heads,
                              sequence_parallel=args.sequence_parallel)
    except ParallelConfigError as e:
        raise ArgumentsError(str(e)) from None
    if args.sequence_parallel:
        try:
            sequence_shards(tp, True, args.seq_length)
        except ConfigError as e:
            raise ArgumentsError(str(e)) from None


def check_sequence_parallel_ds_config(args):
    """DeepSpeed's stock engine must send sequence shards whole (pipe/config.py; the build applies it)."""
    if args.sequence_parallel and args.pipeline_settings.stock:
        try:
            sequence_parallel_ds_config(args.ds_config)
        except ConfigError as e:
            raise ArgumentsError(f"{args.deepspeed_config}: {e}") from None


def rank_coordinates(args, rank):
    """(pipeline stage, data-parallel rank, tensor-parallel rank) of `rank` in DeepSpeed's topology."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    topo = PipeModelDataParallelTopology(num_pp=args.pipeline_model_parallel_size,
                                         num_mp=args.tensor_model_parallel_size, num_dp=args.data_parallel_size)
    coord = topo.get_coord(rank)
    return coord.pipe, coord.data, coord.model
