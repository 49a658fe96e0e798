"""Megatron's recompute on the engines equals no recompute (the single-process reference, fp32, 1e-5: losses,
every first-step gradient, the weights after the steps, the eval loss): --recompute-granularity selective (the
attention core attended again in backward) and full with --recompute-method uniform or block (whole layers, per
virtual stage), under 1F1B, ZB-V and Seq1F1B with the B/W split, packed documents under Seq1F1B, and DeepSpeed's
own engine (selective; full uniform 1). Equal results would also come of recomputing nothing, so each rank also
counts the checkpoints it ran: selective one per layer and training forward (none in evaluation: no backward to
recompute for), full one per checkpointed group and forward (evaluation too: DeepSpeed's checkpoint runs it), the
groups being Megatron's (schedules/recompute.checkpoint_groups: block the first N layers of each chunk, uniform
groups of N from the chunk's first layer). One launch of 2 ranks."""
from megatron_ds.schedules.recompute import Recompute, checkpoint_groups
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (PACKED, assert_matches_reference, engine_rank_run, packed_micro_batch, reference_run,
                               tiny_config)

PP, LAYERS, STEPS, GAS, SEQ, LR = 2, 8, 2, 4, 64, 1e-3  # lr as test_seq1f1b.py: segment-wise sums differ in order
SELECTIVE = dict(recompute_granularity="selective")


def full(method, n):
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True}  # balanced at 64 tokens: 40, 24
CASES = [  # (pipeline section, recompute), the first run without packed documents, the last with them
    ({"schedule": "1f1b"}, SELECTIVE), ({"schedule": "1f1b"}, full("uniform", 3)), ({"schedule": "1f1b"}, full("block", 2)),
    ({"schedule": "zbv"}, SELECTIVE), ({"schedule": "zbv"}, full("uniform", 2)), ({"schedule": "zbv"}, full("block", 1)),
    (SEQ1F1B, SELECTIVE), (SEQ1F1B, full("uniform", 2)), (SEQ1F1B, full("block", 1)),
    (None, SELECTIVE), (None, full("uniform", 1)),  # DeepSpeed's own engine
]
PACKED_CASES = [(dict(SEQ1F1B, seq_splits=4), SELECTIVE), (dict(SEQ1F1B, seq_splits=4), full("block", 1))]


def counting_rank_run(cases, packed_cases):
    """engine_rank_run of every case, each with the number of DeepSpeed checkpoints it ran, by what they ran:
    the attention core ("core") or pipeline layers ("layers")."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction
    original, counts = CheckpointFunction.forward, {}

    def forward(ctx, run_function, all_outputs, *args):
        kind = "core" if getattr(run_function, "__name__", "") == "_masked_attention" else "layers"
        counts[kind] = counts.get(kind, 0) + 1
        return original(ctx, run_function, all_outputs, *args)
    CheckpointFunction.forward = staticmethod(forward)
    results = []
    for batch, runs in ((None, cases), (packed_micro_batch, packed_cases)):
        for pipeline, recompute in runs:
            counts.clear()
            model = {**recompute, **(PACKED if batch else {})}
            out = engine_rank_run(PP, GAS, STEPS, pipeline, num_layers=LAYERS, seq=SEQ, lr=LR, model=model,
                                  batch=batch)
            results.append(dict(out, checkpoints=dict(counts)))
    return results


def expected_checkpoints(pipeline, recompute, facts):
    """{kind: count} a rank runs: per transformer layer and training forward (selective), per checkpointed group
    and forward, evaluation's included (full)."""
    forwards = GAS * (pipeline or {}).get("seq_splits", 1)
    parts, chunks = facts["parts"], facts["chunks"]
    is_layer = [0 < i <= LAYERS for i in range(parts[-1])]  # embedding, the layers, final norm, head
    stages = [st for _, st in chunks] if chunks else [facts["stage"]]
    per_chunk = [is_layer[parts[st]:parts[st + 1]] for st in stages]
    if recompute == SELECTIVE:
        return {"core": sum(map(sum, per_chunk)) * forwards * STEPS}
    settings = Recompute(*(recompute[f"recompute_{key}"] for key in ("granularity", "method", "num_layers")))
    groups = sum(sum(c for _, _, c in checkpoint_groups(settings, layers)) for layers in per_chunk)
    return {"layers": groups * forwards * (STEPS + 1)}


def test_recompute_equals_no_recompute():
    per_rank = run_ranks(PP, counting_rank_run, CASES, PACKED_CASES, timeout=900)
    refs = [reference_run(tiny_config(LAYERS, SEQ), 1, GAS, STEPS, lr=LR),
            reference_run(tiny_config(LAYERS, SEQ, **PACKED), 1, GAS, STEPS, lr=LR, batch=packed_micro_batch)]
    for i, (pipeline, recompute) in enumerate(CASES + PACKED_CASES):
        results = [r[i] for r in per_rank]
        try:
            assert_matches_reference(results, refs[i >= len(CASES)])
            for r in results:
                assert r["checkpoints"] == expected_checkpoints(pipeline, recompute, r["engine"]), r["engine"]
        except AssertionError as exc:
            raise AssertionError(f"{pipeline} {recompute}: {exc}") from None



def test_selective_under_compiled_layers_and_the_split():
    """Compiled layers ("pipeline.compile_layers") with selective recompute: the core between two graphs of each
    layer, the deferred weight GEMMs through the graphs' carriers (ZB-V; Seq1F1B with the B/W split), equal to
    the eager reference (LLaMA-style: every compiled piece runs)."""
    from tests.pipe.test_compile_engine import LLAMA, LR as COMPILED_LR, compiled_rank_runs
    pipelines = [{"schedule": "zbv", "compile_layers": True}, dict(SEQ1F1B, compile_layers=True)]
    ref = reference_run(tiny_config(4, SEQ, **LLAMA), 1, GAS, STEPS, lr=COMPILED_LR)
    per_rank = run_ranks(PP, compiled_rank_runs, PP, GAS, STEPS, pipelines, num_layers=4, seq=SEQ,
                         model=dict(LLAMA, **SELECTIVE), lr=COMPILED_LR, timeout=1500)
    for r in per_rank:
        assert r[0]["dynamo"]["graphs"] > 0 and r[0]["dynamo"]["unplanned"] == {}, r[0]["dynamo"]
    for i, pipeline in enumerate(pipelines):
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{pipeline}: {exc}") from None
