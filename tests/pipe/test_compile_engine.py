"""Compiled transformer layers ("pipeline.compile_layers", model/compile.py) on ScheduleEngine equal the
eager single-process reference: loss, every gradient (first step), the weights after 3 optimizer steps
and the eval loss, 1e-5 fp32, under zbv (B/W split, V placement), seq1f1b k=2 + B/W split (segments
through the static K/V cache of "pipeline.cuda_graphs"), interleaved and bitpipe (fused backward), at
PP=2 and PP=2 x DP=2 (ZeRO-1); activation checkpointing and post-validation ride along on two of the
cases. The loss is compiled too (compile_loss): every rank holds it under one of the schedules. A
LLaMA-style tiny model (RMSNorm, SwiGLU, RoPE, grouped K/V) so every compiled piece runs. One launch per
layout: a rank compiles each graph once and every case after the first reuses it (inductor's on-disk
cache serves a second launch)."""
import pytest

from tests.gpt_harness import assert_matches_reference, engine_rank_runs, reference_run, tiny_config

LAYERS, STEPS, GAS = 4, 3, 2
# Compiled kernels round differently from eager ones (fused reductions: RMSNorm, softmax), about 1e-7.
# Adam divides each gradient by its own running magnitude, so an element whose gradient is that small
# moves by up to lr whatever it is: at the harness's lr 1e-2 three steps can part such an element by
# 1.2e-5 (zbv at PP2xDP2); at 1e-3 the weights still move by ~3e-3 and the 1e-5 check keeps its bite.
LR = 1e-3
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
PIPELINES = [
    {"schedule": "zbv", "post_validation": True},
    # cuda_graphs: on CPU no graph is replayed, but the K/V cache is the static one CUDA graphs need
    {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True, "activation_checkpoint_interval": 1,
     "cuda_graphs": True},
    {"schedule": "interleaved", "virtual_stages": 2},
    {"schedule": "bitpipe"},
]


def compiled_rank_runs(*args, **kwargs):
    """engine_rank_runs, plus what dynamo did on this rank: graphs compiled, graph breaks not by design,
    and the loss's compiled variants (shapes, training and evaluation)."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from megatron_ds.model.compile import compile_seconds, unplanned_graph_breaks
    from megatron_ds.model.layers import gpt_loss
    results = engine_rank_runs(*args, **kwargs)
    dynamo = dict(graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"], seconds=compile_seconds(),
                  unplanned=unplanned_graph_breaks(), loss_graphs=len(_debug_get_cache_entry_list(gpt_loss.__code__)))
    return [dict(r, dynamo=dynamo) for r in results]


@pytest.mark.parametrize("world,pp", [(2, 2), (4, 2)], ids=["pp2", "pp2xdp2"])
def test_compiled_layers_match_eager_reference(world, pp):
    from megatron_ds.testing.launcher import run_ranks
    ref = reference_run(tiny_config(LAYERS, **LLAMA), world // pp, GAS, STEPS, lr=LR)
    pipelines = [{**p, "compile_layers": True} for p in PIPELINES]
    per_rank = run_ranks(world, compiled_rank_runs, pp, GAS, STEPS, pipelines, num_layers=LAYERS, model=LLAMA,
                         lr=LR, timeout=1500)
    for r in per_rank:  # the layers did run compiled, and dynamo broke its graphs only where designed to
        assert r[0]["dynamo"]["graphs"] > 0 and r[0]["dynamo"]["seconds"] > 0, r[0]["dynamo"]
        # the loss too: zbv computes it on rank 0, the others on the last rank
        assert r[0]["dynamo"]["loss_graphs"] > 0, r[0]["dynamo"]
        assert r[0]["dynamo"]["unplanned"] == {}, r[0]["dynamo"]["unplanned"]
    for i, pipeline in enumerate(pipelines):
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{pipeline}: {exc}") from None
