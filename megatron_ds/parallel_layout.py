"""Start-up checks of a tensor/context/pipeline/data-parallel layout: pure functions, no process group.

Each failure is one ParallelConfigError naming the flags and the rule broken; the
training front end turns it into exit code 2 before any process group starts.
"""
from megatron_ds.errors import UserError


class ParallelConfigError(UserError, ValueError):
    pass


def data_parallel_size(world_size: int, pipeline_parallel: int, tensor_parallel: int = 1,
                       context_parallel: int = 1) -> int:
    """world / (TP x CP x PP): the one home of the rule "TP x CP x PP divides the world" (the flags, the
    pipeline's topology and the tensor-parallel groups all ask here). Raise ParallelConfigError unless it does.
    The topology's "data" axis is DP x CP (context-parallel ranks inner: Megatron's tp-cp-dp-pp order), which
    the callers building groups get by leaving `context_parallel` at 1."""
    tp, pp, cp = tensor_parallel, pipeline_parallel, context_parallel
    if pp < 1 or world_size % pp:
        raise ParallelConfigError(f"--pipeline-model-parallel-size {pp} must divide the world size {world_size} "
                                  "(the number of processes the launcher started)")
    if tp < 1 or cp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size {tp}"
                                  + (f", --context-parallel-size {cp}" if cp != 1 else "")
                                  + f" and --pipeline-model-parallel-size {pp} must be at least 1")
    if world_size % (tp * cp * pp):
        sizes = (f"--tensor-model-parallel-size {tp} x " + (f"--context-parallel-size {cp} x " if cp > 1 else "")
                 + f"--pipeline-model-parallel-size {pp} = {tp * cp * pp}")
        raise ParallelConfigError(f"{sizes} must divide the world size {world_size} (the data-parallel size is "
                                  f"world / ({'TP x CP x PP' if cp > 1 else 'TP x PP'}))")
    return world_size // (tp * cp * pp)


def context_unit(cp: int, tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """What every sequence (and Seq1F1B segment) length must divide by at CP `cp`: 2 x CP (Megatron-core's
    load-balanced layout, model/context_parallel/layout.py, cuts it into 2 x CP equal chunks, rank r holding
    chunks r and 2CP-1-r), times TP under --sequence-parallel (a rank's tokens cut TP ways again)."""
    return 2 * cp * (tensor_parallel if sequence_parallel and tensor_parallel > 1 else 1)


def unit_name(cp: int, tensor_parallel: int = 1, sequence_parallel: bool = False) -> str:
    """The flags `context_unit` multiplies, as the refusals name them."""
    extra = context_unit(cp, tensor_parallel, sequence_parallel) > 2 * cp
    return "2 x --context-parallel-size" + (" x --tensor-model-parallel-size (--sequence-parallel)" if extra else "")


def layout_problem(length: int, cp: int, what: str = "--seq-length", tensor_parallel: int = 1,
                   sequence_parallel: bool = False) -> str:
    """Why `length` tokens cannot be laid out over `cp` context-parallel ranks ('' when they can): the one home
    of the rule "2 x CP (x TP under --sequence-parallel) divides the sequence", torch-free so that the flags'
    checks (pipe/plan/segments.context_shards) and the layout (model/context_parallel/layout.py) share it."""
    if cp < 1:
        return f"--context-parallel-size must be at least 1, got {cp}"
    unit = context_unit(cp, tensor_parallel, sequence_parallel)
    if length % unit:
        return (f"{what} ({length}) must be divisible by {unit_name(cp, tensor_parallel, sequence_parallel)} "
                f"({unit}): the sequence is cut into 2 x CP equal chunks, rank r holding chunks r and 2CP-1-r"
                + (", each split again over the tensor-parallel ranks" if unit > 2 * cp else ""))
    return ""


def hierarchical_problem(cp: int, comm: str, sizes) -> str:
    """Why --hierarchical-context-parallel-sizes `sizes` (A, P: the all-to-all over A consecutive CP ranks, the
    ring over P groups of them) cannot go with --context-parallel-size `cp` and --cp-comm-type `comm` ('' when
    they can; None sizes: not given). The one home of the rule: the flags, the ds_config and GPTConfig ask here."""
    if comm != "a2a+p2p":
        return ("" if sizes is None else f"--hierarchical-context-parallel-sizes is --cp-comm-type a2a+p2p's: "
                f"--cp-comm-type is {comm}")
    if sizes is None and cp == 1:
        return ""  # nothing to split: the comm type goes unused, as the others' do at CP 1
    if sizes is None:
        return ("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the all-to-all over A "
                f"consecutive ranks, the ring over P groups, A x P = --context-parallel-size {cp})")
    if (not isinstance(sizes, (list, tuple)) or len(sizes) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
        return f"--hierarchical-context-parallel-sizes takes two whole numbers A P, got {sizes!r}"
    a, p = sizes
    if a * p != cp:
        return (f"--hierarchical-context-parallel-sizes {a} {p}: their product {a * p} must equal "
                f"--context-parallel-size {cp}")
    if a < 2 or p < 2:
        return (f"--hierarchical-context-parallel-sizes {a} {p}: each must be at least 2 (A = 1 is --cp-comm-type "
                "p2p, P = 1 is a2a)")
    return ""


def check_parallel_layout(*, world_size, tensor_parallel, pipeline_parallel, num_attention_heads,
                          ffn_hidden_size, padded_vocab_size, num_key_value_heads=None,
                          sequence_parallel=False, context_parallel=1):
    """Raise ParallelConfigError unless TP x CP x PP divides the world and the model splits over TP ranks."""
    data_parallel_size(world_size, pipeline_parallel, tensor_parallel, context_parallel)
    check_model_split(tensor_parallel, num_attention_heads, ffn_hidden_size, padded_vocab_size, num_key_value_heads,
                      sequence_parallel)


def check_model_split(tensor_parallel, num_attention_heads, ffn_hidden_size, padded_vocab_size,
                      num_key_value_heads=None, sequence_parallel=False):
    """Raise ParallelConfigError unless the model splits evenly over `tensor_parallel` ranks.

    `padded_vocab_size` is the vocabulary after Megatron's padding (a multiple of
    make_vocab_size_divisible_by * TP, or --pad-vocab-size-to).
    """
    tp = tensor_parallel
    if sequence_parallel and tp == 1:
        raise ParallelConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks: it "
                                  "needs --tensor-model-parallel-size > 1")
    divisible = [("--num-attention-heads", num_attention_heads, "each rank keeps whole query heads"),
                 ("--num-key-value-heads", num_key_value_heads, "each rank keeps whole key/value heads"),
                 ("--ffn-hidden-size", ffn_hidden_size, "each rank keeps an equal slice of the MLP"),
                 ("the padded vocabulary size", padded_vocab_size, "each rank keeps an equal slice of the "
                  "embedding (pad it with --make-vocab-size-divisible-by or --pad-vocab-size-to)")]
    for flag, value, why in divisible:
        if value is not None and value % tp:
            raise ParallelConfigError(f"{flag} ({value}) must be divisible by --tensor-model-parallel-size "
                                      f"({tp}): {why}")


# -- the batch: global = micro-batch x accumulation steps x data-parallel size (the one home of that arithmetic:
# the flags' merge with the ds_config, training/config/arguments._merge_batch, and a plan made from a ds_config alone,
# pipe/plan/plan.micro_batches_per_step)
def global_batch_size(micro_batch: int, steps: int, data_parallel: int) -> int:
    return micro_batch * steps * data_parallel


def accumulation_steps(global_batch: int, micro_batch: int, data_parallel: int) -> int | None:
    """global / (micro x DP); None unless micro x DP divides the global batch."""
    per_step = micro_batch * data_parallel
    return None if global_batch % per_step else global_batch // per_step


def micro_batch_size(global_batch: int, steps: int, data_parallel: int) -> int | None:
    """global / (steps x DP); None unless steps x DP divides the global batch."""
    return accumulation_steps(global_batch, steps, data_parallel)
