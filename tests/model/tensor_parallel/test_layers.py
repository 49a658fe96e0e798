"""Every tensor-parallel layer equals its dense layer (fp32): forward output, input gradient and the
gathered weight gradients, fused and with the weight GEMM deferred to the W op (bit-identical)."""
import pytest
import torch

TOL = 1e-6
WORLDS = [2, 4]


def _worst(results, key, field):
    return max(r[key][field] for r in results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("deferred", [False, True], ids=["fused", "deferred-w"])
def test_parallel_linear_equals_dense(tp_results, world, kind, sp, deferred):
    results = tp_results(world)
    key = (kind, sp, deferred)
    assert _worst(results, key, "init") == 0.0  # the same full matrix whatever the TP size
    for field in ("out", "grad_x", "grad_w", "grad_b"):
        assert _worst(results, key, field) < TOL, (field, _worst(results, key, field))
    assert all(r[key]["deferred_to_w"] for r in results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_deferred_weight_gradient_is_bit_identical_to_fused(tp_results, world, kind, sp):
    for r in tp_results(world):
        fused, deferred = r[kind, sp, False]["local_grads"], r[kind, sp, True]["local_grads"]
        assert all(torch.equal(a, b) for a, b in zip(fused, deferred))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_block_with_grouped_kv_heads_and_swiglu_equals_dense(tp_results, world, sp):
    """Fused QKV split by query heads with their K/V groups, SwiGLU gate|up split alike."""
    results = tp_results(world)
    for field in ("out", "grad_x", "grad_w", "grad_b"):
        assert _worst(results, ("block", sp), field) < TOL, (field, _worst(results, ("block", sp), field))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_embedding_equals_dense(tp_results, world, sp):
    results = tp_results(world)
    assert _worst(results, ("embedding", sp), "init") == 0.0
    assert _worst(results, ("embedding", sp), "out") == 0.0  # one nonzero row per token: the sum is exact
    assert _worst(results, ("embedding", sp), "grad_w") < TOL
    assert [(r["embedding", sp]["start"], r["embedding", sp]["rows"]) for r in results] == \
        [(8 * rank, 8) for rank in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_vocab_parallel_cross_entropy_equals_torch_on_gathered_logits(tp_results, world):
    for r in tp_results(world):
        ce = r["cross_entropy"]
        assert ce["loss"] < TOL and ce["grad"] < TOL
        assert ce["mean"] < TOL and ce["segment"] < TOL
        assert ce["bf16"] < 1e-5  # bf16 logits, fp32 loss
        assert ce["dtypes"] == (torch.float32, torch.float32)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_chunked_head_loss_equals_dense_head_and_loss(tp_results, world, sp, deferred):
    for r in tp_results(world):
        c = r["chunked_loss", sp, deferred]
        assert c["loss"] < 1e-6 and c["grad_x"] < 1e-6 and c["grad_w"] < 1e-6 and c["segment"] < 1e-6, c
        assert c["left_to_w"]  # under a B op the weight gradient waits for W


@pytest.mark.parametrize("world", WORLDS)
def test_mappings_round_trip(tp_results, world):
    for r in tp_results(world):
        m = r["mappings"]
        assert m["split_gather"] == (True, True)
        assert m["last_dim"] == (True, True)
        assert m["reduce_scatter_gather"][0] < TOL and m["reduce_scatter_gather"][1] < TOL


@pytest.mark.parametrize("world", WORLDS)
def test_rng_tracker_drops_alike_in_replicated_regions_and_apart_in_partitioned_ones(tp_results, world):
    for r in tp_results(world):
        rng = r["rng"]
        replicated, partitioned = rng["replicated"].view(world, -1), rng["partitioned"].view(world, -1)
        assert all(torch.equal(replicated[0], replicated[i]) for i in range(world))
        assert not any(torch.equal(partitioned[0], partitioned[i]) for i in range(1, world))
        assert rng["after"] and rng["replayed"]  # a fork leaves the default stream alone; states replay


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_per_layer_equal_megatrons_formulas(tp_results, world):
    for sp, (counted, formula) in tp_results(world)[0]["comm_count"].items():
        assert counted == formula, sp


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "bloom", "qwen3", "qwen3-kv16"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp+deferred-w"])
def test_gpt_model_split_over_tp_ranks_equals_dense(tp_results, world, family, sp):
    """GPTModel with tensor_model_parallel_size=world: gathered logits, vocab-parallel loss and every
    gathered gradient equal the dense model's (LLaMA: grouped K/V heads, SwiGLU, RoPE, untied head,
    no biases; BLOOM: ALiBi slopes per rank's heads, embedding norm; Qwen3: LLaMA's with the per-head q/k
    norms, whose weight each rank holds whole and whose gradient shares sum to the dense one; and with
    --kv-channels 16, heads wider than h / heads: each rank's sections of q, k, v and c_proj's columns)."""
    for r in tp_results(world):
        case = r["model", family, sp]
        assert case["names"]
        assert case["queued"] == (2 * 4 + 1 if sp else 0)  # B left every linear's and the head's weight GEMM to W
        for field in ("logits", "loss", "grads"):
            assert case[field] < TOL, (field, case[field])
