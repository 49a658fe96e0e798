"""PP=2 x TP=2 (4 ranks): GPT-2 and LLaMA-style models split over two tensor-parallel ranks train
under the pipeline schedules exactly like the single-process reference (fp32, 1e-5: losses, every
first-step gradient and every weight after the steps, gathered over the TP ranks; eval loss;
global gradient norm, so DeepSpeed's clipping counts each slice once). One launch for every case."""
import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (assert_matches_reference, capture_grads_before_reduce, ds_config, layer_key,
                               micro_batch, optimizer_for, reference_run, tiny_config)

PP, TP, STEPS, GAS, LAYERS, LR, CLIP = 2, 2, 2, 4, 4, 1e-3, 0.05
FAMILIES = {
    "gpt2": {},
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, ffn_hidden_size=48,
                  layernorm_epsilon=1e-6),
}
SCHEDULES = [{"schedule": "1f1b"}, {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zb-h1"},
             {"schedule": "zbv"}, {"schedule": "bitpipe"},
             {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}]
CASES = [("gpt2", s) for s in SCHEDULES] + [("llama", {"schedule": "1f1b"}), ("llama", {"schedule": "zbv"})]


def _full(module, tensors, group):
    """{layer key: tensor} with every tensor-parallel slice gathered into the whole tensor (collective)."""
    from megatron_ds.model.tensor_parallel import gather_full
    out = {}
    for name, _ in module.named_parameters():
        owner, pname = name.rsplit(".", 1)
        key = layer_key(module, name)
        out[key] = gather_full(module.get_submodule(owner), pname, tensors[key], group)
    return out


def tp_engine_run(family, pipeline):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.model.tensor_parallel import get_parallel_state
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(LAYERS, **FAMILIES[family], tensor_model_parallel_size=TP)
    dp = dist.get_world_size() // (PP * TP)
    cfg = ds_config(PP, dp, GAS, clip=CLIP, pipeline=pipeline, lr=LR)
    module = build_pipeline_module(config, cfg, PP)
    engine = initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR))
    grads = []
    capture_grads_before_reduce(engine, grads)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        batches = iter([micro_batch(step, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
    group = get_parallel_state().get_tensor_model_parallel_group()
    weights = _full(module, {layer_key(module, n): p.detach() for n, p in module.named_parameters()}, group)
    eval_batches = iter([micro_batch(99, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
    return dict(losses=losses, grads=_full(module, grads[0], group), weights=weights, dp_rank=dp_rank,
                eval_loss=float(engine.eval_batch(eval_batches)), grad_norms=norms)


def all_cases():
    return [tp_engine_run(family, pipeline) for family, pipeline in CASES]


@pytest.fixture(scope="module")
def tp_runs():
    return run_ranks(PP * TP, all_cases, timeout=900)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{family}-{p['schedule']}" for family, p in CASES])
def test_pp2_tp2_equals_single_process_reference(tp_runs, index):
    family, _ = CASES[index]
    ref = reference_run(tiny_config(LAYERS, **FAMILIES[family]), 1, GAS, STEPS, clip=CLIP, lr=LR)
    results = [rank[index] for rank in tp_runs]
    assert_matches_reference(results, ref)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5, \
            (r["grad_norms"], ref["grad_norms"])
    assert ref["grad_norms"][0] > CLIP  # clipping is active, so a miscounted norm would change the weights
