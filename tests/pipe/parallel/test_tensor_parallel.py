"""Tensor parallelism on 4 ranks: GPT-2 and LLaMA-style models split over the tensor-parallel ranks train
under the pipeline schedules exactly like the single-process reference (fp32, 1e-5: losses, every
first-step gradient and every weight after the steps, gathered over the TP ranks; eval loss; global
gradient norm, so DeepSpeed's clipping counts each slice once). PP=2 x TP=2 under every named schedule,
without and with --sequence-parallel (sequence shards between stages, norm and row-bias gradients summed
over the TP group, B/W split included); with it also DeepSpeed's stock engine at PP=1 (what pretrain_gpt
runs without a "pipeline.schedule"): TP=2 x DP=2 and TP=4. Each schedule sees both families. Qwen3's per-head
query/key norms (--qk-layernorm), whose gradient each TP rank holds a share of, under ZB-V, Seq1F1B with
--sequence-parallel and the stock engine without it.

Activation recompute (--checkpoint-activations: DeepSpeed's checkpoint around every transformer layer) with
--sequence-parallel at TP=2 and hidden and attention dropout 0.1: the recomputed forward must draw the masks
of the original one (from DeepSpeed's RNG tracker, which its checkpoint saves and restores), so the run with
recompute equals the run without it bit for bit (losses, gathered gradients and weights), under the stock
engine (TP=2 x DP=2) and ZB-H1 (PP=2 x TP=2, B/W split: the recompute runs in B, W after it). One launch for
every case."""
import functools
import time

import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, assert_matches_reference, capture_grads_before_reduce, ds_config, layer_key,
                               micro_batch, optimizer_for, reference_run, tiny_config, whole_tensors)

WORLD, GAS, LAYERS, LR, CLIP = 4, 4, 4, 1e-3, 0.05
FAMILIES = {
    "gpt2": {},
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, ffn_hidden_size=48,
                  layernorm_epsilon=1e-6),
}
FAMILIES["qwen3"] = dict(FAMILIES["llama"], qk_layernorm=True)  # per-head norms: gradient shares summed over TP
PP2_TP2 = dict(pp=2, tp=2, sp=False, steps=2)
SP = dict(PP2_TP2, sp=True, steps=3)
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}
CASES = [("gpt2", s, PP2_TP2) for s in (
    {"schedule": "1f1b"}, {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zb-h1"},
    {"schedule": "zb-h2"}, {"schedule": "zbv"}, {"schedule": "bitpipe"}, SEQ1F1B)] + [
    ("llama", {"schedule": "1f1b"}, PP2_TP2), ("llama", {"schedule": "zbv"}, PP2_TP2),
    # sequence parallel: the family each schedule has not met above
    ("gpt2", {"schedule": "1f1b"}, SP), ("gpt2", {"schedule": "zbv"}, SP),
    ("llama", {"schedule": "interleaved", "virtual_stages": 2}, SP),
    ("llama", {"schedule": "zb-h1", "post_validation": True}, SP),
    ("llama", {"schedule": "zb-h2"}, SP), ("llama", {"schedule": "bitpipe"}, SP), ("llama", SEQ1F1B, SP),
    # DeepSpeed's stock engine (shards sent whole), also at one stage (LLaMA's 2 K/V heads do not split 4 ways)
    ("gpt2", None, SP), ("llama", None, dict(pp=1, tp=2, sp=True, steps=3)),
    ("gpt2", None, dict(pp=1, tp=4, sp=True, steps=3)),
    # --qk-layernorm: the per-head norms' gradients summed over TP with and without SP, stock engine included
    ("qwen3", {"schedule": "zbv"}, PP2_TP2), ("qwen3", SEQ1F1B, SP),
    ("qwen3", None, dict(pp=1, tp=2, sp=False, steps=2)),
]
# (pipeline, layout) of the recompute pairs; each runs without, then with activation checkpointing. One step is
# enough: its 4 micro-batches interleave forwards (drawing masks) with recomputing backwards (replaying them).
DROPOUT = 0.1
RECOMPUTE = [(None, dict(pp=1, tp=2, sp=True, steps=1)), ({"schedule": "zb-h1"}, dict(SP, steps=1))]


def _case_id(case):
    family, pipeline, layout = case
    pipeline = pipeline or {"schedule": "stock"}
    extra = ("-post-validation" if pipeline.get("post_validation") else "") + ("-sp" if layout["sp"] else "")
    return f"{family}-{pipeline['schedule']}-pp{layout['pp']}tp{layout['tp']}{extra}"


def tp_engine_run(family, pipeline, layout, dropout=0.0, recompute=False):
    """`dropout`: hidden and attention dropout; `recompute`: DeepSpeed's activation checkpoint per layer."""
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.model.tensor_parallel import get_parallel_state, model_parallel_manual_seed
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    start = time.perf_counter()
    pp, tp = layout["pp"], layout["tp"]
    config = tiny_config(LAYERS, **FAMILIES[family], tensor_model_parallel_size=tp, sequence_parallel=layout["sp"],
                         hidden_dropout=dropout, attention_dropout=dropout)
    dp = dist.get_world_size() // (pp * tp)
    cfg = ds_config(pp, dp, GAS, clip=CLIP, pipeline=pipeline, lr=LR)
    module = build_pipeline_module(config, cfg, pp, activation_checkpoint_interval=int(recompute))
    engine = initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR))
    # every case draws its dropout masks from the same start (as pretrain seeds them)
    model_parallel_manual_seed(1234 + 100 * engine.grid.get_pipe_parallel_rank(),
                               get_parallel_state().get_tensor_model_parallel_rank())
    grads = []
    capture_grads_before_reduce(engine, grads)  # sequence-parallel gradients are summed over TP by then
    dp_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(layout["steps"]):
        batches = iter([micro_batch(step, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
    weights = whole_tensors(engine, config, {layer_key(module, n): p.detach() for n, p in module.named_parameters()})
    eval_batches = iter([micro_batch(EVAL_STEP, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
    return dict(losses=losses, grads=whole_tensors(engine, config, grads[0]), weights=weights, dp_rank=dp_rank,
                eval_loss=float(engine.eval_batch(eval_batches)), grad_norms=norms, engine=type(engine).__name__,
                seconds=time.perf_counter() - start)


def all_cases():
    runs = [tp_engine_run(*case) for case in CASES]
    return runs + [[tp_engine_run("gpt2", pipeline, layout, DROPOUT, recompute) for recompute in (False, True)]
                   for pipeline, layout in RECOMPUTE]


@pytest.fixture(scope="module")
def tp_runs():
    return run_ranks(WORLD, all_cases, timeout=1200)


@functools.lru_cache(maxsize=None)
def _reference(family, dp, steps):
    return reference_run(tiny_config(LAYERS, **FAMILIES[family]), dp, GAS, steps, clip=CLIP, lr=LR)


def _max_diffs(results, ref):
    """(max abs, max relative) difference over losses, gradients and weights (relative to the largest
    entry of each reference tensor), for the report."""
    import torch
    pairs = [(torch.tensor(a), torch.tensor(b)) for r in results for a, b in zip(r["losses"], ref["losses"])]
    pairs += [(r["weights"][k], w) for r in results for k, w in ref["weights"].items() if k in r["weights"]]
    for key, g in ref["grads"].items():  # gradients before the data-parallel mean: one copy per DP rank
        by_dp = {r["dp_rank"]: r["grads"][key] for r in results if key in r["grads"]}
        pairs.append((sum(by_dp.values()) / len(by_dp), g))
    diffs = [((a - b).abs().max().item(), b.abs().max().item()) for a, b in pairs]
    return max(d for d, _ in diffs), max(d / m for d, m in diffs if m > 0)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_tensor_parallel_equals_single_process_reference(tp_runs, index):
    family, pipeline, layout = CASES[index]
    results = [rank[index] for rank in tp_runs]
    ref = _reference(family, WORLD // (layout["pp"] * layout["tp"]), layout["steps"])
    assert_matches_reference(results, ref)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5, \
            (r["grad_norms"], ref["grad_norms"])
    assert ref["grad_norms"][0] > CLIP  # clipping is active, so a miscounted norm would change the weights
    if pipeline is None:
        summed = layout["sp"] or family == "qwen3"  # gradient shares to sum over the TP group
        assert results[0]["engine"] == ("SequenceParallelPipelineEngine" if summed else "PipelineEngine")
    print(_case_id(CASES[index]), "max abs/rel diff %.2e / %.2e" % _max_diffs(results, ref),
          "%.1f s" % max(r["seconds"] for r in results))


@pytest.mark.parametrize("index", range(len(RECOMPUTE)),
                         ids=[_case_id(("gpt2", p, layout)) + "-dropout-recompute" for p, layout in RECOMPUTE])
def test_recompute_replays_the_dropout_masks(tp_runs, index):
    """With recompute, the same losses, gathered first-step gradients and final weights as without it (exactly:
    the same operations on the same masks); and dropout is on (the losses differ from dropout 0's)."""
    pipeline, layout = RECOMPUTE[index]
    plain, recomputed = ([rank[len(CASES) + index][i] for rank in tp_runs] for i in (0, 1))
    ref = _reference("gpt2", WORLD // (layout["pp"] * layout["tp"]), layout["steps"])
    for a, b in zip(plain, recomputed):
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        for what in ("grads", "weights"):
            assert a[what].keys() == b[what].keys()
            worst = max((a[what][k] - b[what][k]).abs().max().item() for k in a[what])
            assert worst == 0.0, f"{what}: max abs difference {worst:.3g} between the runs without and with recompute"
        # dropout drops: without it the runs equal the reference within 1e-5 (above); here they differ by ~1e-3
        assert max(abs(x - y) for x, y in zip(a["losses"], ref["losses"])) > 1e-4, (a["losses"], ref["losses"])
    print(_case_id(("gpt2", pipeline, layout)), f"dropout {DROPOUT}: losses {plain[0]['losses']} without and with "
          f"recompute; dropout 0: {ref['losses']};", "%.1f s / %.1f s" % (
              max(r["seconds"] for r in plain), max(r["seconds"] for r in recomputed)))
