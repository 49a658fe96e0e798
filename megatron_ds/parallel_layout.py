"""Start-up checks of a tensor/pipeline/data-parallel layout: pure functions, no process group.

Each failure is one ParallelConfigError naming the flags and the rule broken; the
training front end turns it into exit code 2 before any process group starts.
"""
from megatron_ds.errors import UserError


class ParallelConfigError(UserError, ValueError):
    pass


def check_parallel_layout(*, world_size, tensor_parallel, pipeline_parallel, num_attention_heads,
                          ffn_hidden_size, padded_vocab_size, num_key_value_heads=None,
                          sequence_parallel=False):
    """Raise ParallelConfigError unless TP x PP divides the world and the model splits over TP ranks."""
    tp, pp = tensor_parallel, pipeline_parallel
    if tp < 1 or pp < 1:
        raise ParallelConfigError(f"--tensor-model-parallel-size {tp} and --pipeline-model-parallel-size {pp} "
                                  f"must be at least 1")
    if world_size % (tp * pp):
        raise ParallelConfigError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = "
                                  f"{tp * pp} must divide the world size {world_size} (the data-parallel size is "
                                  f"world / (TP x PP))")
    check_model_split(tp, num_attention_heads, ffn_hidden_size, padded_vocab_size, num_key_value_heads,
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
