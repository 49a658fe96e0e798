"""Start-up layout checks: one message naming the flag and the rule, no process group needed."""
import pytest

from megatron_ds.model.tensor_parallel import ParallelConfigError, check_parallel_layout

GOOD = dict(world_size=8, tensor_parallel=2, pipeline_parallel=2, num_attention_heads=8, num_key_value_heads=4,
            ffn_hidden_size=64, padded_vocab_size=512, sequence_parallel=True)


def test_a_layout_that_splits_evenly_passes():
    check_parallel_layout(**GOOD)
    check_parallel_layout(**{**GOOD, "tensor_parallel": 1, "sequence_parallel": False, "num_key_value_heads": None})


@pytest.mark.parametrize("change, flag, rule", [
    (dict(world_size=6), "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2", "divide the world size 6"),
    (dict(tensor_parallel=1), "--sequence-parallel", "--tensor-model-parallel-size > 1"),
    (dict(num_attention_heads=9), "--num-attention-heads (9)", "divisible by --tensor-model-parallel-size (2)"),
    (dict(num_key_value_heads=1), "--num-key-value-heads (1)", "divisible by --tensor-model-parallel-size (2)"),
    (dict(ffn_hidden_size=63), "--ffn-hidden-size (63)", "divisible by --tensor-model-parallel-size (2)"),
    (dict(padded_vocab_size=511), "the padded vocabulary size (511)", "--make-vocab-size-divisible-by"),
    (dict(tensor_parallel=0), "--tensor-model-parallel-size 0", "at least 1"),
])
def test_each_bad_layout_is_one_message_naming_the_flag_and_the_rule(change, flag, rule):
    with pytest.raises(ParallelConfigError) as err:
        check_parallel_layout(**{**GOOD, **change})
    assert flag in str(err.value) and rule in str(err.value)
    assert "\n" not in str(err.value)
