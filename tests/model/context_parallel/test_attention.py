"""Context-parallel attention (model/context_parallel/) on 2 and 4 gloo ranks, every --cp-comm-type, equals full
attention of the whole sequence on one process, relative to the largest value compared, within 1e-6 (outputs) and
2e-6 (gradients) in fp32. Attention alone is compared with the exact values (the reference in fp64): fp32 SDPA on one
process is itself up to 1.0e-6 (outputs 2e-7) off them here, as allgather and a2a, which attend with it, show; p2p's
blockwise softmax rounds alike (measured at most 1.3e-6 for gradients, 6.7e-7 for outputs). Attention alone
(outputs and the gradients of q, k, v) causal and within packed documents (borders inside chunks, a one-token
document, documents spanning chunks), with as many K/V heads as query heads and grouped (GQA), the sequence whole and
as 2 and 4 uneven Seq1F1B segments attending to the cached K/V of the earlier ones; and CausalSelfAttention with
LLaMA's options (RoPE at global positions, GQA, no bias) and BLOOM's (ALiBi), with and without selective recompute,
packed documents (RoPE by their restarted positions) or not, against the layer at CP 1 (outputs, input gradients,
weight gradients summed over the CP ranks). One launch per CP size serves every case (cp_ranks.run_all)."""
import pytest

from megatron_ds.testing.launcher import run_ranks

from .cp_ranks import run_all

TOLERANCE = {"out": 1e-6}  # gradients: 2e-6 (the module's docstring)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_ranks(world, run_all, world, timeout=600)
        return cache[world]
    return get


def _check(results, world, kind):
    checked = 0
    for rank, cases in enumerate(results(world)):
        for case, diffs in cases.items():
            if case[0] != kind:
                continue
            for what, (diff, scale) in diffs.items():
                assert scale > 1e-3, (world, rank, case, what)  # the compared values are not all ~0
                assert diff <= TOLERANCE.get(what, 2e-6) * max(1.0, scale), (world, rank, case, what, diff, scale)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_attention_alone_equals_full_attention(results, world):
    # 3 comm types x (MHA, GQA) x (causal, documents) x (whole, 2 and 4 segments) x (out, dq, dk, dv) per rank
    assert _check(results, world, "attention") == world * 3 * 2 * 2 * 3 * 4


@pytest.mark.parametrize("world", [2, 4])
def test_layer_equals_the_layer_on_the_whole_sequence(results, world):
    layer_cases = 3 * 2 * 2 * 2 - (0 if world == 2 else 4)  # LLaMA's 2 K/V heads: no a2a at CP 4
    assert _check(results, world, "layer") >= world * layer_cases * 3


@pytest.mark.parametrize("world", [2, 4])
def test_a2a_refuses_kv_heads_that_do_not_divide_in_one_line(results, world):
    for cases in results(world):
        message = cases["a2a refusal"]
        assert "do not divide by --context-parallel-size" in message and "\n" not in message


def test_p2p_with_attention_dropout_is_refused_in_one_line():
    from megatron_ds.gpt_config import GPTConfig
    shape = dict(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, max_position_embeddings=16,
                 context_parallel_size=2, attention_dropout=0.1)
    with pytest.raises(ValueError, match="--cp-comm-type p2p attends blockwise without dropout"):
        GPTConfig(cp_comm_type="p2p", **shape)
    GPTConfig(cp_comm_type="allgather", **shape)
