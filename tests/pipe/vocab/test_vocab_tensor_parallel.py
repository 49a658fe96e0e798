"""Vocabulary parallelism under tensor and sequence parallelism (pipe/vocab/vocab_passes.py with the TP
collectives of model/vocab_parallel.py), and on the BLOOM family, equals the single-process reference:
losses, eval loss, the global gradient norm (clipping active, so every TP rank's rows must count in it),
every first-step gradient and the weights after 3 steps with the TP slices and the vocabulary blocks
gathered back into whole matrices, 1e-5 fp32 at lr 1e-3 (as tests/pipe/vocab/test_vocab_engine.py).
PP=2 x TP=2 under 1F1B, ZB-V and Seq1F1B (B/W split), each tied (GPT-2: learned positions, so under SP
stage 0 gathers the sequence to add them) and untied (LLaMA: rope, GQA, SwiGLU), each with and without
--sequence-parallel; BLOOM (embedding layernorm, alibi) at TP=1 (PP=2 x DP=2, ZB-V) and with TP=2 and SP
(1F1B: the embedding norm on the gathered sequence); --loss-chunk-size under Seq1F1B with TP=2 and SP (the
S pass's TP collectives per chunk of tokens). One launch of 4 ranks runs every case.
"""
import functools

import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config
from tests.pipe.parallel.test_tensor_parallel import FAMILIES

WORLD, GAS, LAYERS, STEPS, LR, CLIP = 4, 4, 4, 3, 1e-3, 0.05
MODELS = {**FAMILIES, "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
          "llama-chunked": dict(FAMILIES["llama"], loss_chunk_size=12)}  # S and T 12 of 32 tokens at a time
SCHEDULES = {"1f1b": {}, "zbv": {},
             "seq1f1b": {"seq_splits": 2, "seq_split_method": "even", "split_backward": True}}
CASES = [(model, schedule, dict(pp=2, tp=2, sp=sp)) for schedule in SCHEDULES for sp in (False, True)
         for model in ("gpt2", "llama")] + [
    ("bloom", "zbv", dict(pp=2, tp=1, sp=False)), ("bloom", "1f1b", dict(pp=2, tp=2, sp=True)),
    ("llama-chunked", "seq1f1b", dict(pp=2, tp=2, sp=True))]


def _case_id(case):
    model, schedule, layout = case
    return f"{model}-{schedule}-pp{layout['pp']}tp{layout['tp']}" + ("-sp" if layout["sp"] else "")


def vp_tp_run(model, schedule, layout):
    pipeline = {"schedule": schedule, "vocab_parallel": True, **SCHEDULES[schedule]}
    return engine_rank_run(layout["pp"], GAS, STEPS, pipeline, clip=CLIP, num_layers=LAYERS, lr=LR,
                           model=dict(MODELS[model], tensor_model_parallel_size=layout["tp"],
                                      sequence_parallel=layout["sp"]))


def all_cases():
    return [vp_tp_run(*case) for case in CASES]


@pytest.fixture(scope="module")
def runs():
    return run_ranks(WORLD, all_cases, timeout=900)


@functools.lru_cache(maxsize=None)
def _reference(model, dp):
    return reference_run(tiny_config(LAYERS, **MODELS[model]), dp, GAS, STEPS, clip=CLIP, lr=LR)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_vocab_parallel_with_tensor_parallel_equals_reference(runs, index):
    model, schedule, layout = CASES[index]
    results = [rank[index] for rank in runs]
    ref = _reference(model, WORLD // (layout["pp"] * layout["tp"]))
    assert_matches_reference(results, ref)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5, \
            (r["grad_norms"], ref["grad_norms"])
    assert ref["grad_norms"][0] > CLIP  # clipping is active, so a miscounted norm would change the weights
