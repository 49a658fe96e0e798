"""Tensor- and context-parallel flags and the (pipe, data, model) layout of the ranks.

The ranks are laid out as DeepSpeed's PipeModelDataParallelTopology: axes (pipe, data,
model), model fastest. Rank r is tensor rank r % TP, data-axis rank (r // TP) % (DP x CP) and
pipeline stage r // (TP x DP x CP), with DP = world / (PP x TP x CP). Under context parallelism the
data axis holds the CP ranks inner (Megatron's tp-cp-dp-pp order): data-axis rank d is context-parallel
rank d % CP of data-parallel replica d // CP, and gradients and ZeRO-1 shards go over the whole axis.

The context-parallel flags may sit in the ds_config's "context_parallel" section too, keyed by the flags'
names with underscores ({"context_parallel": {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
"hierarchical_context_parallel_sizes": [2, 2]}}, as the "moe" section carries the MoE flags); given twice they
must agree.

The layout and the model split are checked at parse time (no torch, no process group),
so a bad combination is one line and exit code 2 before anything starts.
"""
from megatron_ds.cp_section import COMM_TYPES, DEFAULTS, HIERARCHICAL, SECTION, section_of, section_problem
from megatron_ds.parallel_layout import ParallelConfigError, check_parallel_layout, hierarchical_problem
from megatron_ds.pipe.plan.config import ConfigError, sequence_parallel_ds_config
from megatron_ds.pipe.plan.segments import context_shards, sequence_shards

from ..errors import ArgumentsError


def add_parallel_args(parser):
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="split heads, MLP and vocabulary over this many ranks (Megatron's tensor parallelism)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="also split the sequence outside attention and MLP over the tensor-parallel ranks "
                        "(Megatron's sequence parallelism; pipeline messages carry the shards)")
    g = parser.add_argument_group("context parallelism")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="split each sequence over this many ranks, attention exchanging keys and values "
                        "(Megatron-core's context parallelism; default 1)")
    g.add_argument("--cp-comm-type", choices=COMM_TYPES, default=None,
                   help="how attention exchanges them: p2p (a ring), allgather, a2a (heads <-> sequence), "
                        "a2a+p2p (a2a within groups of A ranks, a ring over the P groups; default p2p)")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None, metavar=("A", "P"),
                   help="--cp-comm-type a2a+p2p's levels: the all-to-all over A consecutive context-parallel "
                        "ranks, the ring over P of those groups (A x P = --context-parallel-size; Megatron-core's)")


def merge_context_parallel(args, ds_config: dict):
    """args.context_parallel_size, args.cp_comm_type and args.hierarchical_context_parallel_sizes from the flags and the ds_config's "context_parallel"
    section (cp_section.py checks its shape; one may give what the other leaves out; given twice they must agree)."""
    src = args.deepspeed_config
    problem = section_problem(ds_config)
    if problem:
        raise ArgumentsError(f"{src}: {problem}")
    section, merged = section_of(ds_config), {}
    for dest, default in DEFAULTS.items():
        flag, value, given = "--" + dest.replace("_", "-"), section.get(dest), getattr(args, dest)
        if given is not None and value is not None and given != value:
            shown = " ".join(map(str, given)) if isinstance(given, list) else given  # as typed: nargs=2's A P
            raise ArgumentsError(f'{flag} {shown} disagrees with ds_config "{SECTION}.{dest}" = {value} in {src}; '
                                 "give one of them, or make them equal")
        merged[dest] = next((v for v in (given, value, default) if v is not None), None)
    sizes = merged[HIERARCHICAL] and tuple(merged[HIERARCHICAL])
    args.context_parallel_size, args.cp_comm_type = merged["context_parallel_size"], merged["cp_comm_type"]
    args.hierarchical_context_parallel_sizes = sizes
    problem = hierarchical_problem(args.context_parallel_size, args.cp_comm_type, sizes)
    if problem:
        raise ArgumentsError(problem)


def check_parallel_args(args):
    """Check TP x CP x PP against the world, the model split and the context-parallel cut of the sequence
    (arguments.py derives data_parallel_size)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    # Without --pad-vocab-size-to the tokenizer pads to a multiple of make_vocab_size_divisible_by x TP,
    # which TP divides by construction; the size itself is known only once the tokenizer is loaded.
    try:
        check_parallel_layout(world_size=args.world_size, tensor_parallel=tp, pipeline_parallel=pp,
                              num_attention_heads=args.num_attention_heads,
                              ffn_hidden_size=args.gpt_config.ffn_hidden_size,
                              padded_vocab_size=args.pad_vocab_size_to, num_key_value_heads=args.num_key_value_heads,
                              sequence_parallel=args.sequence_parallel, context_parallel=cp)
    except ParallelConfigError as e:
        raise ArgumentsError(str(e)) from None
    try:
        sequence_shards(tp, args.sequence_parallel, args.seq_length)
        context_shards(cp, tp, args.sequence_parallel, args.seq_length)
    except ConfigError as e:
        raise ArgumentsError(str(e)) from None


def check_sequence_parallel_ds_config(args):
    """DeepSpeed's stock engine must send sequence shards whole (pipe/plan/config.py; the build applies it)."""
    if args.sequence_parallel and args.pipeline_settings.stock:
        try:
            sequence_parallel_ds_config(args.ds_config)
        except ConfigError as e:
            raise ArgumentsError(f"{args.deepspeed_config}: {e}") from None


def rank_coordinates(args, rank):
    """(pipeline stage, data-parallel rank, tensor-parallel rank) of `rank` in DeepSpeed's topology."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    cp = getattr(args, "context_parallel_size", 1)
    topo = PipeModelDataParallelTopology(num_pp=args.pipeline_model_parallel_size,
                                         num_mp=args.tensor_model_parallel_size, num_dp=args.data_parallel_size * cp)
    coord = topo.get_coord(rank)
    return coord.pipe, coord.data // cp, coord.model
