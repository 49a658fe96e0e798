"""A mixture-of-experts GPT with packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss)
on ScheduleEngine equals the single-process reference with the same flags and experts (fp32, 1e-5: losses, every
first-step gradient, the weights and expert biases after the steps, the eval loss), as the dense models do
(tests/pipe/test_documents_engine.py), and each run's first loss is the mean of every document's loss scored
alone (dropless routing scores each token by itself: no document changes another's). Under 1F1B, ZB-V (B/W split,
two chunks per rank) and Seq1F1B with 2 segments (documents crossing the cut, the router's counts weighed by
their whole micro-batch), at PP=2, with the softmax router (aux and z losses, a shared expert) and DeepSeek-V3's
sigmoid router with its expert bias, which moves by the whole batch's counts."""
import functools

import torch

from megatron_ds.model import GPTModel
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (PACKED, assert_matches_reference, engine_rank_run, packed_micro_batch, packed_text,
                               reference_run, tiny_config)
from tests.model.test_documents import documents_alone
from tests.pipe.moe.test_moe_engine import MODELS

STEPS, GAS, SEQ, LAYERS, LR = 2, 4, 64, 4, 1e-3
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}
CASES = [("softmax", {"schedule": "1f1b"}), ("softmax", {"schedule": "zbv"}), ("softmax", SEQ1F1B),
         ("sigmoid", {"schedule": "zbv"}), ("sigmoid", SEQ1F1B)]


def rank_runs(cases):
    return [engine_rank_run(2, GAS, STEPS, pipeline, num_layers=LAYERS, lr=LR, seq=SEQ,
                            model={**MODELS[model], **PACKED}, batch=packed_micro_batch) for model, pipeline in cases]


@functools.lru_cache(maxsize=None)
def _reference(model):
    return reference_run(tiny_config(LAYERS, SEQ, **MODELS[model], **PACKED), 1, GAS, STEPS, lr=LR,
                         batch=packed_micro_batch)


def _documents_alone(model):
    """Step 0's loss as the mean over its micro-batches of each one's documents scored alone (initial weights)."""
    reference = GPTModel(tiny_config(LAYERS, SEQ, **MODELS[model])).eval()
    with torch.no_grad():
        losses = [total / count for total, count in (documents_alone(reference, packed_text(0, i, seq=SEQ))
                                                     for i in range(GAS))]
    return sum(losses) / GAS


def test_moe_with_packed_documents_matches_reference():
    per_rank = run_ranks(2, rank_runs, CASES, timeout=900)
    alone = {model: _documents_alone(model) for model in {m for m, _ in CASES}}
    for i, (model, pipeline) in enumerate(CASES):
        results = [r[i] for r in per_rank]
        try:
            assert_matches_reference(results, _reference(model))
            for r in results:
                assert abs(r["losses"][0] - alone[model]) <= 1e-5, (r["losses"][0], alone[model])
        except AssertionError as exc:
            raise AssertionError(f"{model} {pipeline}: {exc}") from None
