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
weight gradients summed over the CP ranks); two LLaMA-style TransformerLayers run as Seq1F1B segments under CP
(plain, activation-checkpointed, with packed documents and deferred weight gradients or selective recompute) against the whole sequence
at CP 1, with the K/V each rank caches (p2p: 1/C of the positions; a2a: 1/C of the heads); and TP 2 x CP 2 with and
without sequence parallelism; p2p's attention dropout against full attention under the same blocks' masks, and
selective recompute drawing the same dropout masks for every comm type; the messages each comm type sends per
layer; compiled layers; and --cp-comm-type a2a+p2p at CP 4 = 2 x 2 (the all-to-all within pairs of ranks, the ring over
the pairs) on the same cases. One launch per CP size serves every case (cp_ranks.run_all)."""
import pytest

from megatron_ds.testing.launcher import launches_by_world

from .cp_ranks import run_all

TOLERANCE = {"out": 1e-6}  # gradients: 2e-6 (the module's docstring)


@pytest.fixture(scope="module")
def results():
    return launches_by_world(run_all, timeout=600)


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
    # 3 comm types x (MHA, GQA) x (causal, documents) x (whole, 2 and 4 segments) x (out, dq, dk, dv) per rank,
    # and (GQA, documents, 2 segments) p2p in tiles smaller than its chunks, allgather and a2a with the documents
    # attended group by group (documents.py's long path)
    assert _check(results, world, "attention") == world * (3 * 2 * 2 * 3 + 3) * 4


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_attention_is_within_bf16_rounding(results, world):
    # GQA, documents, 2 segments; bf16 keeps 8 bits of mantissa: 2^-8 = 3.9e-3 of a value
    for rank, cases in enumerate(results(world)):
        for comm in ("p2p", "allgather", "a2a"):
            for what, (diff, scale) in cases[("bf16", comm)].items():
                assert diff <= 2e-2 * max(1.0, scale), (world, rank, comm, what, diff, scale)


@pytest.mark.parametrize("world", [2, 4])
def test_layer_equals_the_layer_on_the_whole_sequence(results, world):
    layer_cases = 3 * 2 * 2 * 2 - (0 if world == 2 else 4)  # LLaMA's 2 K/V heads: no a2a at CP 4
    assert _check(results, world, "layer") >= world * layer_cases * 3


@pytest.mark.parametrize("world", [2, 4])
def test_layer_under_yarn_rope_scaling_equals_the_layer_on_the_whole_sequence(results, world):
    # CP rotates by the scaled frequencies and yarn's attention factor, as CP 1 does (p2p, allgather, a2a at CP 2;
    # causal and within documents)
    yarn = {case for cases in results(world) for case in cases if case[:1] == ("layer",) and case[2] == "llama yarn"}
    assert len(yarn) == (3 if world == 2 else 2) * 2  # each also held to the tolerance by the test above


@pytest.mark.parametrize("world", [2, 4])
def test_cp_layers_keep_their_output_and_rope_tables_as_cp1_does(results, world):
    for rank, cases in enumerate(results(world)):
        for comm in ("p2p", "allgather", "a2a"):
            for packed in (False, True):
                keepers, per_layer, both = cases[("shared", comm, packed)]
                # the ring keeps its output and c_proj its input: one storage (no copy for c_proj); allgather's
                # and a2a's output is made after SDPA's (a cat, an all-to-all), which c_proj alone keeps
                assert keepers == ([2, 2] if comm == "p2p" else [1, 1]), (world, rank, comm, packed)
                # cos and sin of the rank's positions (the documents' restarted ones when packed): one pair for
                # both layers of the op, as CP 1's cached tables
                assert per_layer == [2, 2] and both == 2, (world, rank, comm, packed)


@pytest.mark.parametrize("world", [2, 4])
def test_a2a_refuses_kv_heads_that_do_not_divide_in_one_line(results, world):
    for cases in results(world):
        message = cases["a2a refusal"]
        assert "do not divide by --context-parallel-size" in message and "\n" not in message


@pytest.mark.parametrize("world", [2, 4])
def test_selective_recompute_draws_the_same_attention_dropout(results, world):
    for rank, cases in enumerate(results(world)):
        for comm in ("p2p", "allgather", "a2a"):
            for what, (diff, scale) in cases[("recompute dropout", comm)].items():
                assert diff == 0.0 and scale > 1e-3, (world, rank, comm, what)
            assert cases[("dropout effect", comm)] > 0.05  # the masks did drop (relative to the output)


@pytest.mark.parametrize("world", [2, 4])
def test_p2p_attention_dropout_drops_each_block_alike_forward_and_backward(results, world):
    assert _check(results, world, "dropout") == world * 3 * 4  # whole, 2 segments, and 2 in tiles
    for cases in results(world):
        for k in (1, 2):
            assert 0.2 < cases[("dropped", k)] < 0.3  # p = 0.25 of the visible probabilities


@pytest.mark.parametrize("world", [2, 4])
def test_seq1f1b_segments_under_cp_equal_the_whole_sequence(results, world):
    # two LLaMA-style layers; 3 comm types x (2, 4 segments) x (plain, checkpointed, documents + deferred W,
    # documents + selective recompute)
    assert _check(results, world, "segmented") >= world * 3 * 2 * 4 * 4


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_caches_a_cth_of_the_segments_kv(results, world):
    s, kv_heads, head_dim = 16 * world, 4, 4
    for cases in results(world):
        for k in (2, 4):
            assert cases[("kv", "p2p", k)] == [(2, 2, kv_heads, s // world, head_dim)]  # its own chunks
            assert cases[("kv", "allgather", k)] == [(2, 2, kv_heads, s, head_dim)]  # every position
            assert cases[("kv", "a2a", k)] == [(2, 2, kv_heads // world, s, head_dim)]  # its head group


def test_tensor_parallel_times_context_parallel(results):
    # TP 2 x CP 2: (p2p, allgather) x (LLaMA, BLOOM) + a2a x BLOOM, with and without sequence parallelism
    assert _check(results, 4, "tp x cp") >= 4 * 5 * 2 * 3


@pytest.mark.parametrize("world", [2, 4])
def test_each_comm_type_communicates_what_the_docs_say(results, world):
    """Per layer (B = 2 rows of 16 x C tokens, head size 8, fp32): p2p sends the K/V C - 1 times forward, and
    backward C - 1 times and their fp32 gradients C times; allgather gathers K and V once each and sends their
    gradients back by one all-to-all each; a2a exchanges q, k, v and the output (forward), their gradients
    (backward) by one all-to-all each."""
    local, compared = 16, 0  # tokens per rank
    for family, kv_heads in (("llama", 2), ("bloom", 4)):
        kv_bytes = 2 * 2 * kv_heads * local * 8 * 4  # keys and values of one rank
        q_bytes = 2 * 4 * local * 8 * 4
        want = {
            "p2p": ({"cp_send": (world - 1, (world - 1) * kv_bytes)},
                    {"cp_send": (2 * world - 1, (2 * world - 1) * kv_bytes)}),
            "allgather": ({"cp_all_gather": (2, world * kv_bytes)}, {"cp_all_to_all": (2, world * kv_bytes)}),
            "a2a": ({"cp_all_to_all": (4, 2 * q_bytes + kv_bytes)}, {"cp_all_to_all": (4, 2 * q_bytes + kv_bytes)}),
        }
        for cases in results(world):
            for comm, counts in want.items():
                if (comm, family) in cases["comm"]:
                    assert cases["comm"][(comm, family)] == counts, (world, comm, family)
                    compared += 1
    assert compared == world * (6 if world == 2 else 5)  # LLaMA's 2 K/V heads: no a2a at CP 4


def test_compiled_layers_call_cp_attention_out_of_their_graphs(results):
    assert _check(results, 2, "compiled") >= 2 * 4
    for cases in results(2):
        breaks, seconds = cases["graph breaks"]
        assert breaks == {} and seconds > 0


def test_hierarchical_a2a_p2p_equals_full_attention(results):
    # CP 4 = 2 x 2, per rank: attention alone (MHA, GQA) x (causal, documents) x (whole, 2 and 4 segments) x
    # (out, dq, dk, dv); the layer: 3 families x (recompute or not) x (documents or not) x (out, dx, >= 1 weight);
    # two layers as 2 and 4 Seq1F1B segments x 4 variants x (out, dx, >= 1 weight)
    assert _check(results, 4, "a2a+p2p") >= 4 * (2 * 2 * 3 * 4 + 3 * 2 * 2 * 3 + 2 * 4 * 3)
    for rank, cases in enumerate(results(4)):
        assert sum(case[:2] == ("a2a+p2p", "attention") for case in cases if isinstance(case, tuple)) == 12
        for what, (diff, scale) in cases[("bf16", "a2a+p2p")].items():
            assert diff <= 2e-2 * max(1.0, scale), (rank, what, diff, scale)
        for what, (diff, scale) in cases[("recompute dropout", "a2a+p2p")].items():
            assert diff == 0.0 and scale > 1e-3, (rank, what)
        assert cases[("dropout effect", "a2a+p2p")] > 0.05


def test_hierarchical_a2a_p2p_caches_its_head_group_of_its_outer_chunks(results):
    s, kv_heads, head_dim = 64, 4, 4  # K/V heads / A, positions / P
    for cases in results(4):
        for k in (2, 4):
            assert cases[("kv", "a2a+p2p", k)] == [(2, 2, kv_heads // 2, s // 2, head_dim)]


def test_hierarchical_a2a_p2p_communicates_an_a2a_over_a_and_a_ring_over_p(results):
    """The a2a's four all-to-alls each way over the inner 2 ranks (the local q, k, v and output), and the ring of
    P = 2 over K/V blocks the size of a rank's own K/V (2 x the positions at 1/2 of the heads): P - 1 sends forward,
    P - 1 and P gradient sends backward."""
    local = 16
    for family, kv_heads in (("llama", 2), ("bloom", 4)):
        kv_bytes, q_bytes = 2 * 2 * kv_heads * local * 8 * 4, 2 * 4 * local * 8 * 4
        a2a = (4, 2 * q_bytes + kv_bytes)
        for cases in results(4):
            assert cases["comm"][("a2a+p2p", family)] == ({"cp_all_to_all": a2a, "cp_send": (1, kv_bytes)},
                                                          {"cp_all_to_all": a2a, "cp_send": (3, 3 * kv_bytes)})


def test_hierarchical_a2a_p2p_refuses_kv_heads_that_do_not_divide_by_a_in_one_line(results):
    for cases in results(4):
        message = cases["a2a+p2p refusal"]
        assert "do not divide by 2" in message and "hierarchical-context-parallel-sizes" in message
        assert "\n" not in message
