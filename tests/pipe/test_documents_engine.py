"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) on ScheduleEngine equal the
single-process reference with the same flags (fp32, 1e-5: losses, every first-step gradient, the weights after
the steps, the eval loss), and each run's first loss equals the token-weighted mean of every document's loss
computed alone (tests/model/test_documents.py: the reference's own isolation), so no schedule lets attention leak
across documents while its loss looks right.

Every stage reads the micro-batch's tokens and finds the documents itself (pipe/plan/plan.needs_data); a Seq1F1B
segment's queries see the documents of the K/V cache's earlier positions. One launch of 2 ranks: every named
schedule at PP=2 (GPT-2), Seq1F1B with 2 and 4 segments (documents crossing the cuts; the B/W split; activation
recompute), LLaMA (RoPE at restarted positions) and BLOOM (ALiBi), the long path's per-document groups,
vocabulary parallelism, the chunked loss, and DeepSpeed's own engine with --reset-position-ids (learned) and
--eod-mask-loss alone. One launch of 4 ranks: PP=4 (middle stages) under 1F1B, ZB-V and
Seq1F1B, and PP=2 x TP=2 with sequence parallelism (1F1B, Seq1F1B with LLaMA, vocabulary parallel). In the
first launch also "schedule": "auto" (tests/pipe/test_auto_engine.py's way): its own choice, and forced a
rebuild to ZB-V and a swap to Seq1F1B, through its timing and its Seq1F1B probe on packed micro-batches."""
import functools

import pytest
import torch

from megatron_ds.model import GPTModel
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (PACKED, assert_matches_reference, engine_rank_run, packed_micro_batch, packed_text,
                               reference_run, tiny_config)
from tests.model.test_documents import documents_alone
from tests.pipe.test_model_families import FAMILIES as MODEL_FAMILIES

STEPS, GAS, SEQ, LR = 2, 4, 64, 1e-3  # lr as test_seq1f1b.py: segment-wise sums differ in order
FAMILIES = {"gpt2": {}, **MODEL_FAMILIES}
PP2 = dict(pp=2, layers=4)
PP4 = dict(pp=4, layers=8)
TP_SP = dict(pp=2, layers=4, tensor_model_parallel_size=2, sequence_parallel=True)
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 4}  # balanced at 64 tokens: 16, 16, 8, 24
VOCAB = {"vocab_parallel": True}
CASES_PP2 = [("gpt2", {"schedule": name}, PP2) for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "bitpipe",
                                                            "zbv-half", "zbv-min", "dualpipev")] + [
    ("gpt2", {"schedule": "interleaved", "virtual_stages": 2}, PP2),
    ("gpt2", {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}, PP2),
    ("gpt2", dict(SEQ1F1B, activation_checkpoint_interval=1), PP2),
    ("llama", {"schedule": "zbv"}, PP2), ("llama", SEQ1F1B, PP2), ("bloom", SEQ1F1B, PP2),
    ("llama", dict(SEQ1F1B, activation_checkpoint_interval=1), dict(PP2, dense_side=8)),  # the long path: groups
    # of documents, each long one alone, attended again in backward, inside the layer's own recomputation
    ("llama", {"schedule": "1f1b", **VOCAB}, PP2), ("gpt2", {"schedule": "seq1f1b", "seq_splits": 2, **VOCAB}, PP2),
    ("gpt2", {"schedule": "zb-h1"}, dict(PP2, loss_chunk_size=12)),
    # DeepSpeed's own engine: the loss mask rides with the labels, learned positions with the inputs
    ("gpt2", None, dict(PP2, reset_attention_mask=False)),
]
CASES_4 = [("gpt2", {"schedule": "1f1b"}, PP4), ("llama", {"schedule": "zbv"}, PP4), ("bloom", SEQ1F1B, PP4),
           ("gpt2", {"schedule": "1f1b"}, TP_SP),
           ("llama", {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even"}, TP_SP),
           ("gpt2", {"schedule": "1f1b", **VOCAB}, TP_SP)]
MODEL_KEYS = ("tensor_model_parallel_size", "sequence_parallel", "loss_chunk_size", "reset_attention_mask")


AUTO = [None, "zbv", "seq1f1b seq_splits=2 split_backward=True"]  # own choice, a rebuild, a swap to segments
AUTO_STEPS = 3  # it times iterations 0 and 1 (the second on its Seq1F1B probe), switches after the second


def auto_rank_run(label):
    """`"schedule": "auto"` (GPT-2, PP=2) from zb-h1, through its Seq1F1B probe, to `label` (None: its own choice)
    on packed micro-batches, as tests/pipe/test_auto_engine.py runs it on plain ones."""
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.auto import AutoSwitch
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.plan.plan import make_plan
    from megatron_ds.schedules import auto
    from megatron_ds.training.auto_schedule import switch_engine
    from tests.gpt_harness import EVAL_STEP, capture_grads_before_reduce, ds_config, layer_key, optimizer_for
    from tests.pipe.test_auto_engine import forcing
    config = tiny_config(4, SEQ, **PACKED)

    def build(cfg):
        plan, auto_plan = make_plan(config, cfg, 2, 1, SEQ)
        module = build_pipeline_module(config, cfg, 2, plan=plan)
        return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR),
                                 auto_plan=auto_plan)

    AutoSwitch.choose = staticmethod(forcing(label) if label else auto.decide)
    pipeline = {"schedule": "auto", "memory_budget": 4, "timers_start_iter": 0, "timers_end_iter": 2,
                "seq_split_method": "even"}
    engine = build(ds_config(2, dist.get_world_size() // 2, GAS, pipeline=pipeline, lr=LR))
    grads, losses, reports, switched = [], [], [], False
    engine.on_auto_decision = reports.append
    capture_grads_before_reduce(engine, grads)
    for step in range(AUTO_STEPS):
        losses.append(float(engine.train_batch(iter([packed_micro_batch(step, j, seq=SEQ) for j in range(GAS)]))))
        if reports and reports[-1].rebuild and not switched:
            engine, switched = switch_engine(engine, reports[-1].decision, build), True
    weights = {layer_key(engine.module, n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
    eval_loss = float(engine.eval_batch(iter([packed_micro_batch(EVAL_STEP, j, seq=SEQ) for j in range(GAS)])))
    now = engine.plan.schedule
    return dict(losses=losses, grads=grads[0], weights=weights, dp_rank=0, eval_loss=eval_loss,
                now=(now.name, now.seq_splits))


def documents_rank_runs(cases, auto_labels=()):
    from megatron_ds.model import documents
    out = [auto_rank_run(label) for label in auto_labels]
    for family, pipeline, layout in cases:
        model = {**FAMILIES[family], **PACKED, **{k: v for k, v in layout.items() if k in MODEL_KEYS}}
        dense_side = documents.DENSE_SIDE
        documents.DENSE_SIDE = layout.get("dense_side", dense_side)
        try:
            out.append(engine_rank_run(layout["pp"], GAS, STEPS, pipeline, num_layers=layout["layers"], lr=LR,
                                       seq=SEQ, model=model, batch=packed_micro_batch))
        finally:
            documents.DENSE_SIDE = dense_side
    return out


@functools.lru_cache(maxsize=None)
def _reference(family, layers, steps=STEPS, mask=True):
    return reference_run(tiny_config(layers, SEQ, **FAMILIES[family], **dict(PACKED, reset_attention_mask=mask)), 1,
                         GAS, steps, lr=LR, batch=packed_micro_batch)


@functools.lru_cache(maxsize=None)
def _documents_alone(family, layers):
    """Step 0's loss as the mean over its micro-batches of each one's documents scored alone (initial weights)."""
    model = GPTModel(tiny_config(layers, SEQ, **FAMILIES[family])).eval()
    losses = []
    with torch.no_grad():
        for i in range(GAS):
            total, count = documents_alone(model, packed_text(0, i, seq=SEQ))
            losses.append(total / count)
    return sum(losses) / GAS


def _check(cases, per_rank):
    for i, (family, pipeline, layout) in enumerate(cases):
        results = [r[i] for r in per_rank]
        mask = layout.get("reset_attention_mask", True)
        try:
            assert_matches_reference(results, _reference(family, layout["layers"], mask=mask))
            for r in results if mask else ():
                assert abs(r["losses"][0] - _documents_alone(family, layout["layers"])) <= 1e-5
        except AssertionError as exc:
            raise AssertionError(f"{family} {pipeline} {layout}: {exc}") from None


@pytest.mark.parametrize("world,cases,auto_labels", [(2, CASES_PP2, AUTO), (4, CASES_4, ())],
                         ids=["pp2-and-auto", "pp4-and-tp2-sp"])
def test_packed_documents_match_reference_under_every_schedule(world, cases, auto_labels):
    per_rank = run_ranks(world, documents_rank_runs, cases, auto_labels, timeout=900)
    for i, label in enumerate(auto_labels):
        results = [r[i] for r in per_rank]
        assert results[0]["now"] == {"zbv": ("zbv", 1), AUTO[2]: ("seq1f1b", 2)}.get(label, results[0]["now"])
        try:
            assert_matches_reference(results, _reference("gpt2", 4, AUTO_STEPS))
        except AssertionError as exc:
            raise AssertionError(f"auto -> {results[0]['now']}: {exc}") from None
    _check(cases, [r[len(auto_labels):] for r in per_rank])
