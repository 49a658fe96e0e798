"""A transformers causal LM cut by megatron_ds.pipe.hf and run by megatron_ds.initialize equals the same
transformers model trained on one process (tests/hf_harness.py): every step's loss, the first step's gradients
and the weights after 3 AdamW steps within 1e-5 (fp32, dropout 0), by the model's own parameter names. LLaMA
(tied embeddings) under 1f1b, zbv, bitpipe and dualpipev and with packed documents; GPT-2 (learned positions,
Conv1D, tied) under zbv with packed documents; Qwen3, Mistral (a sliding
window that bites), Gemma 3 (sliding layers with their own rotary, capped logits), Phi-3, OLMo 2 and Mixtral
(MoE) under 1f1b or zbv, and Seq1F1B in 2 segments (LLaMA, its B/W split; Mistral, a window across segments), at
PP 2, and zbv under DeepSpeed's activation checkpointing; PP 2 x DP 2 with ZeRO-1 and with packed documents.
Seq1F1B with packed documents (LLaMA): a document begun in the first segment is attended through the K/V cache,
its own keys only. Context parallelism, CP 2 x PP 2 (pipe.hf.engine.build_engine, pretrain_gpt's path): LLaMA
under 1f1b (packed documents) and zbv over the p2p ring, zbv over a2a, Seq1F1B's segments over the ring (packed),
Qwen3 (q/k norms, head_dim apart from hidden / heads) over allgather. "auto" (LLaMA, at PP 2 and PP 2 x DP 2): it
times the cut's own layers on its start-up schedule and probe, decides (rank 0 logs the choice), swaps or rebuilds
through a checkpoint, and still equals the one-process model. One launch per layout.
Each run ends in save_pretrained, whose folder transformers loads with the same weights."""
import functools

import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.hf_harness import assert_matches, build, rank_runs, reference_run

GAS = 4
SPLIT = {"zbv", "dualpipev"}
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True}
# every candidate fits at pp 2, m 4; iterations 0 and 1 timed (1: the probe), the third on the choice
AUTO = {"schedule": "auto", "memory_budget": 4, "timers_start_iter": 0, "timers_end_iter": 2}
LAYOUTS = {  # world, pp, [(family, pipeline section, ZeRO stage, packed documents)], context-parallel size
    "pp2": (2, 2, [("llama", {"schedule": s}, 0, False) for s in ("1f1b", "zbv", "bitpipe", "dualpipev")] + [
        ("llama", {"schedule": "zbv"}, 0, True), ("qwen3", {"schedule": "zbv"}, 0, False),
        ("mistral", {"schedule": "1f1b"}, 0, True), ("gemma3", {"schedule": "zbv"}, 0, True),
        ("phi3", {"schedule": "1f1b"}, 0, False), ("olmo2", {"schedule": "zbv"}, 0, False),
        ("mixtral", {"schedule": "zbv"}, 0, False), ("gpt2", {"schedule": "zbv"}, 0, True),
        # Seq1F1B, 2 segments: earlier segments' K/V in the engine's cache, B/W split; a window across segments
        ("llama", SEQ1F1B, 0, False), ("mistral", {**SEQ1F1B, "seq_split_method": "even"}, 0, False),
        # packed documents in segments: a document begun in segment 0 seen through the cache, its own keys only
        ("llama", SEQ1F1B, 0, True),
        # DeepSpeed's activation checkpoints over the decoder layers (not the embedding: its integer inputs)
        ("llama", {"schedule": "zbv", "activation_checkpoint_interval": 1}, 0, True), ("llama", AUTO, 1, False)], 1),
    "pp2xdp2": (4, 2, [("llama", {"schedule": "zbv"}, 1, False), ("llama", {"schedule": "1f1b"}, 0, True),
                       ("llama", AUTO, 1, False)], 1),
    # each sequence over 2 ranks (chunks r and 3 - r of 4): the ring, allgather, a2a ("cp_comm_type")
    "cp2xpp2": (4, 2, [("llama", {"schedule": "1f1b"}, 0, True), ("llama", {"schedule": "zbv"}, 0, False),
                       ("llama", {"schedule": "zbv", "cp_comm_type": "a2a"}, 0, True),
                       ("llama", {**SEQ1F1B, "seq_split_method": "even"}, 0, True),
                       ("qwen3", {"schedule": "1f1b", "cp_comm_type": "allgather"}, 0, True)], 2),
}


@functools.lru_cache(maxsize=None)
def reference(family, n, packed):
    return reference_run(family, n, packed=packed)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def launched(request, tmp_path_factory):
    world, pp, cases, cp = LAYOUTS[request.param]
    saved = tmp_path_factory.mktemp(request.param)
    per_rank = run_ranks(world, rank_runs, pp, GAS, cases, save_dir=str(saved), cp=cp, timeout=900, quiet=True)
    return request.param, cases, per_rank, saved


def test_hf_models_train_as_on_one_process(launched):
    layout, cases, per_rank, _ = launched
    _, pp, _, cp = LAYOUTS[layout]
    dp = len(per_rank) // (pp * cp)
    for i, (family, pipeline, zero, packed) in enumerate(cases):
        ref = reference(family, dp * GAS, packed)
        results = [r[i] for r in per_rank]
        try:
            assert_matches(results, ref)
        except AssertionError as exc:
            raise AssertionError(f"{layout} {family} {pipeline} zero={zero} packed={packed}: {exc}") from None
        if pipeline["schedule"] == "auto":
            check_auto(results)
            continue
        segmented = pipeline["schedule"] == "seq1f1b"
        ours = segmented or cp > 1  # pipe.hf's engine, else megatron_ds.initialize's
        assert {r["engine"] for r in results} == {"HFScheduleEngine" if ours else "ForeignScheduleEngine"}
        assert {r["segments"] for r in results} == ({(8, 8)} if segmented else {None})  # balanced: 8, 8 too
        assert (zero == 0) == all(r["grads"] is not None for r in results)
        # the split schedules take the weight gradients in W ops (autograd's split), the others in the backward
        split = (pipeline["schedule"] in SPLIT or pipeline.get("split_backward")) and \
            "activation_checkpoint_interval" not in pipeline  # a reentrant checkpoint's backward runs whole in B
        assert (sum(r["in_w"] for r in results) > 0) == bool(split), (family, pipeline)


def check_auto(results):
    """Every rank took the same decision after the window (its measured costs: the cut's embedding, decoder
    layers and head + loss); rank 0's log names it."""
    assert {r["engine"] for r in results} == {"HFScheduleEngine"}
    assert len({r["auto"][:2] for r in results}) == 1, [r["auto"][:2] for r in results]
    label, _, log = results[0]["auto"]
    assert f"auto schedule: {label} (simulated makespan" in log and "head + loss F/B/W=" in log, log


def test_the_trained_weights_load_in_transformers(launched):
    """save_pretrained's folder (the weights gathered from every pipeline rank) is a transformers model of the
    same class whose weights are the reference's after 3 steps."""
    from transformers import AutoModelForCausalLM
    layout, cases, per_rank, saved = launched
    _, pp, _, cp = LAYOUTS[layout]
    dp = len(per_rank) // (pp * cp)
    for i, (family, pipeline, _, packed) in enumerate(cases):
        ref = reference(family, dp * GAS, packed)
        model = AutoModelForCausalLM.from_pretrained(saved / str(i), local_files_only=True)
        assert type(model).__name__ == type(build(family)).__name__
        weights = dict(model.named_parameters())
        assert set(weights) == set(ref["weights"])
        for name, w in weights.items():
            diff = (w - ref["weights"][name]).abs().max().item()
            assert diff <= 1e-5, f"{layout} {family} {pipeline}: saved {name} differs by {diff:.3g}"
