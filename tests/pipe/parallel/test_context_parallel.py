"""Context parallelism in the pipeline engines: a LLaMA-style GPT (RoPE, GQA, SwiGLU, RMSNorm, untied head) with
each sequence split over the context-parallel ranks trains under the pipeline schedules exactly like the
single-process reference on the same samples (fp32, 1e-5: losses, every first-step gradient, every weight after
the steps, the eval loss and the global gradient norm, with clipping active so that a miscounted norm would show).

One 4-rank launch: CP 2 x PP 2 under 1f1b, zbv, seq1f1b k=2 with the B/W split, interleaved, zb-h1, bitpipe,
dualpipev, seq1f1b k=4 (balanced), packed documents (all three document flags), allgather and a2a, DeepSpeed's own
engine (also CP 2 x DP 2), mixtures of experts (EP 2 over the CP pair), TP 2 x CP 2 with and without sequence
parallelism, CP 4 (also a2a+p2p at 2 x 2 under 1f1b, and Seq1F1B k=2 with packed documents), vocabulary
parallelism, and "auto" (its own choice; forced to zbv, a rebuild through a
checkpoint). One 8-rank launch: CP 2 x PP 2 x DP 2. Each rank reads its replica's whole micro-batch; the engine
cuts each op's tokens, position ids and labels to the rank's two chunks (pipe/parallel/context_parallel.py), a message
between stages holds (b, s / CP, h), and DeepSpeed's gradient mean and ZeRO-1 run over the data axis (DP x CP)."""
import dataclasses
import functools
import time

import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, PACKED, assert_matches_reference, capture_grads_before_reduce, ds_config,
                               expert_biases, layer_key, micro_batch, optimizer_for, packed_micro_batch, reference_run, tiny_config,
                               whole_tensors)

WORLD, GAS, LAYERS, LR, CLIP, SEQ = 4, 4, 4, 1e-3, 0.05, 32
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False, ffn_hidden_size=48,
             layernorm_epsilon=1e-6)
CP2_PP2 = dict(pp=2, cp=2, comm="p2p", packed=False, steps=3, moe=None, ep=1, tp=1, sp=False)
TP2_CP2 = dict(CP2_PP2, pp=1, tp=2, sp=True)  # sequence parallelism: (b, s / (CP x TP), h) between layers
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}
CASES = [({"schedule": "1f1b"}, CP2_PP2), ({"schedule": "zbv"}, CP2_PP2), (SEQ1F1B, CP2_PP2),
         ({"schedule": "interleaved", "virtual_stages": 2}, CP2_PP2), ({"schedule": "zb-h1"}, CP2_PP2),
         ({"schedule": "bitpipe"}, CP2_PP2), ({"schedule": "dualpipev"}, CP2_PP2),
         ({"schedule": "seq1f1b", "seq_splits": 4}, CP2_PP2),
         ({"schedule": "1f1b"}, dict(CP2_PP2, packed=True)), (SEQ1F1B, dict(CP2_PP2, packed=True)),
         ({"schedule": "zbv"}, dict(CP2_PP2, comm="allgather")), (SEQ1F1B, dict(CP2_PP2, comm="allgather")),
         ({"schedule": "1f1b"}, dict(CP2_PP2, comm="a2a")), (SEQ1F1B, dict(CP2_PP2, comm="a2a")),
         (None, CP2_PP2), (None, dict(CP2_PP2, pp=1, comm="allgather")),  # DeepSpeed's own engine
         # mixtures of experts (tests/pipe/moe/test_moe_engine.py's): the balancing counts of the whole sequence, the
         # router losses' gradient shares; experts shared out over the CP pair (EP 2 of the data axis)
         ({"schedule": "1f1b"}, dict(CP2_PP2, moe="softmax", ep=2)), (SEQ1F1B, dict(CP2_PP2, moe="seq_aux", ep=2)),
         (None, dict(CP2_PP2, moe="sigmoid")),
         # with tensor and sequence parallelism (TP fastest, then CP): a rank's chunks split again over TP
         ({"schedule": "1f1b"}, TP2_CP2), (None, dict(TP2_CP2, comm="allgather")),
         ({"schedule": "zb-h1"}, dict(TP2_CP2, sp=False)),
         # post-validation's optimizer step; full recompute (DeepSpeed's checkpoint of every layer) in Seq1F1B's B
         ({"schedule": "zb-h1", "post_validation": True}, CP2_PP2),
         ({**SEQ1F1B, "activation_checkpoint_interval": 1}, CP2_PP2),
         # overlapped forward and backward units (a MoE's all-to-alls in flight)
         ({"schedule": "1f1b", "overlap": True}, dict(CP2_PP2, moe="softmax", ep=2)),
         # CP 4: one group of the four ranks, each holding chunks r and 7 - r
         ({"schedule": "1f1b"}, dict(CP2_PP2, pp=1, cp=4)), (SEQ1F1B, dict(CP2_PP2, pp=1, cp=4, comm="allgather")),
         # CP 4 = 2 x 2 by a2a+p2p: the all-to-all within the pairs {0, 1}, {2, 3}, the ring over {0, 2}, {1, 3}
         ({"schedule": "1f1b"}, dict(CP2_PP2, pp=1, cp=4, comm="a2a+p2p")),
         (SEQ1F1B, dict(CP2_PP2, pp=1, cp=4, comm="a2a+p2p", packed=True)),
         # vocabulary parallelism: each CP rank's pipeline runs the slices' passes on its tokens
         ({"schedule": "1f1b", "vocab_parallel": True}, CP2_PP2),
         ({**SEQ1F1B, "vocab_parallel": True}, dict(CP2_PP2, packed=True))]





def _case_id(case):
    pipeline, layout = case
    pipeline = pipeline or {"schedule": "stock"}
    extra_schedule = "".join(f"-{name}" for name in ("vocab_parallel", "post_validation", "overlap",
                                                      "activation_checkpoint_interval") if pipeline.get(name))
    extra = ("-packed" if layout["packed"] else "") + (f"-tp{layout['tp']}{'-sp' if layout['sp'] else ''}"
                                                        if layout["tp"] > 1 else "") + (f"-moe-{layout['moe']}-ep{layout['ep']}" if layout["moe"] else "")
    return (f"{pipeline['schedule']}{pipeline.get('seq_splits', '')}{extra_schedule}-cp{layout['cp']}pp{layout['pp']}-"
            f"{layout['comm']}{extra}")


def _model(layout, ep=1):
    if layout["moe"]:
        from tests.pipe.moe.test_moe_engine import MODELS
        model = MODELS[layout["moe"]]
        return {**model, "moe": dataclasses.replace(model["moe"], expert_model_parallel_size=ep)}
    return dict(LLAMA, **(PACKED if layout["packed"] else {}))


def _batch(layout):
    return functools.partial(packed_micro_batch if layout["packed"] else micro_batch)


def cp_engine_run(pipeline, layout):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    start = time.perf_counter()
    pp, cp = layout["pp"], layout["cp"]
    config = tiny_config(LAYERS, SEQ, **_model(layout, layout["ep"]), context_parallel_size=cp,
                         cp_comm_type=layout["comm"], tensor_model_parallel_size=layout["tp"],
                         sequence_parallel=layout["sp"],
                         hierarchical_context_parallel_sizes=(2, cp // 2) if layout["comm"] == "a2a+p2p" else None)
    dp = dist.get_world_size() // (pp * cp * layout["tp"])
    cfg = ds_config(pp, dp, GAS, clip=CLIP, pipeline=pipeline, lr=LR)  # train_batch_size counts samples
    module = build_pipeline_module(config, cfg, pp, (pipeline or {}).get("activation_checkpoint_interval", 0))
    engine = initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR))
    grads = []
    capture_grads_before_reduce(engine, grads)  # each CP rank's share (x CP) of its replica's gradient
    data_rank = engine.grid.get_data_parallel_rank()  # DP x CP ranks
    replica = data_rank // cp  # whose samples this rank reads
    batch = _batch(layout)
    losses, norms = [], []
    for step in range(layout["steps"]):
        batches = iter([batch(step, replica * GAS + j, config.vocab_size, SEQ) for j in range(GAS)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
    weights = whole_tensors(engine, config, {layer_key(module, n): p.detach() for n, p in module.named_parameters()})
    weights.update(expert_biases((int(name), layer) for name, layer in module.named_children() if name.isdigit()))
    eval_batches = iter([batch(EVAL_STEP, replica * GAS + j, config.vocab_size, SEQ) for j in range(GAS)])
    message = engine.plan.message_shape((0, 0, 0, 0)) if pipeline else None
    # "dp_rank": the data-axis rank, so that assert_matches_reference averages the gradients over DP x CP
    return dict(losses=losses, grads=whole_tensors(engine, config, grads[0]), weights=weights, dp_rank=data_rank,
                eval_loss=float(engine.eval_batch(eval_batches)), grad_norms=norms, message=message,
                train_batch_size=engine.train_batch_size(), engine=dict(stage=engine.stage_id),
                seconds=time.perf_counter() - start)


def cp_auto_run(layout, forced=None, budget=4):
    """"schedule": "auto" under CP: it starts on zb-h1, times it and its probe (Seq1F1B with 4 segments, each cut
    2 x CP ways), decides (`forced`: picks that candidate) and switches (through a checkpoint when the choice is
    placed otherwise, the new engine built of the ds_config in samples)."""
    import torch.distributed as dist
    from megatron_ds.schedules import auto
    from megatron_ds.pipe.auto import AutoSwitch
    from megatron_ds.training.auto_schedule import switch_engine
    from tests.gpt_harness import auto_engine_builder
    pp, cp = layout["pp"], layout["cp"]
    config = tiny_config(LAYERS, SEQ, **_model(layout), context_parallel_size=cp, cp_comm_type=layout["comm"])
    dp = dist.get_world_size() // (pp * cp)
    build = auto_engine_builder(config, pp, dp, LR)
    if forced:
        from tests.pipe.test_auto_engine import forcing
    AutoSwitch.choose = staticmethod(forcing(forced) if forced else auto.decide)
    pipeline = {"schedule": "auto", "memory_budget": budget, "timers_start_iter": 0, "timers_end_iter": 2,
                "seq_split_method": "even"}
    engine = build(ds_config(pp, dp, GAS, clip=CLIP, pipeline=pipeline, lr=LR))
    probe, reports, grads, losses, norms, rebuilt = engine.auto.auto_plan.probe, [], [], [], [], False
    engine.on_auto_decision = reports.append
    capture_grads_before_reduce(engine, grads)
    data_rank = engine.grid.get_data_parallel_rank()
    for step in range(layout["steps"]):
        batches = iter([micro_batch(step, data_rank // cp * GAS + j, config.vocab_size, SEQ) for j in range(GAS)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
        if reports and reports[-1].rebuild and not rebuilt:
            engine, rebuilt = switch_engine(engine, reports[-1].decision, build), True
    module = engine.module
    weights = whole_tensors(engine, config, {layer_key(module, n): p.detach() for n, p in module.named_parameters()})
    eval_batches = iter([micro_batch(EVAL_STEP, data_rank // cp * GAS + j, config.vocab_size, SEQ) for j in range(GAS)])
    return dict(losses=losses, grads=grads[0], weights=weights, dp_rank=data_rank,  # TP 1: whole tensors (of the first module)
                eval_loss=float(engine.eval_batch(eval_batches)), grad_norms=norms, probe=probe,
                now=(engine.plan.schedule.name, engine.plan.schedule.seq_splits), reports=len(reports),
                rebuilt=rebuilt,
                message=None, train_batch_size=engine.train_batch_size(), seconds=0.0)


def all_cases():
    return [cp_engine_run(*case) for case in CASES] + [cp_auto_run(CP2_PP2), cp_auto_run(CP2_PP2, "zbv")]


@pytest.fixture(scope="module")
def cp_runs():
    return run_ranks(WORLD, all_cases, timeout=1500)


@functools.lru_cache(maxsize=None)
def _reference(packed, dp, steps, moe=None):
    layout = dict(CP2_PP2, packed=packed, moe=moe)
    return reference_run(tiny_config(LAYERS, SEQ, **_model(layout)), dp, GAS, steps, clip=CLIP, lr=LR,
                         batch=_batch(layout))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_context_parallel_equals_single_process_reference(cp_runs, index):
    pipeline, layout = CASES[index]
    results = [rank[index] for rank in cp_runs]
    dp = WORLD // (layout["pp"] * layout["cp"] * layout["tp"])
    ref = _reference(layout["packed"], dp, layout["steps"], layout["moe"])
    if layout["ep"] > 1:  # an expert's gradient on the EP rank holding it sums its EP group's tokens
        from tests.pipe.moe.test_moe_engine import assert_expert_parallel_matches
        assert_expert_parallel_matches(results, ref, dp * layout["cp"])
    else:
        assert_matches_reference(results, ref)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5, \
            (r["grad_norms"], ref["grad_norms"])
        if pipeline and (pipeline.get("seq_splits", 1) == 1 or pipeline.get("seq_split_method") == "even"):
            shards = layout["cp"] * (layout["tp"] if layout["sp"] else 1)
            assert r["message"] == (2, SEQ // pipeline.get("seq_splits", 1) // shards, 32)  # (b, s / CP, h)
        assert r["train_batch_size"] == 2 * GAS * dp * layout["cp"]  # DeepSpeed counts each CP rank as a replica
    assert ref["grad_norms"][0] > CLIP
    print(_case_id(CASES[index]), "losses", ref["losses"], "%.1f s" % max(r["seconds"] for r in results))


@pytest.mark.parametrize("which", [0, 1], ids=["own-choice", "zbv-rebuilt"])
def test_auto_chooses_and_switches_under_context_parallelism(cp_runs, which):
    results = [rank[len(CASES) + which] for rank in cp_runs]
    ref = _reference(False, 1, CP2_PP2["steps"])
    assert_matches_reference(results, ref)
    for r in results:
        assert r["probe"] == {"schedule": "seq1f1b", "seq_splits": 4, "split_backward": True}
        assert r["reports"] == 1 and r["train_batch_size"] == 2 * GAS * 2
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5
        assert not which or (r["now"] == ("zbv", 1) and r["rebuilt"])  # through a checkpoint, another placement
    print("auto under CP 2 x PP 2 chose", results[0]["now"])


# CP 2 x PP 2 x DP 2 (8 ranks): two replicas, each reading its own samples, gradients and ZeRO-1 over DP x CP
WIDE = [({"schedule": "1f1b"}, CP2_PP2), (SEQ1F1B, dict(CP2_PP2, packed=True))]


def wide_cases():
    return [cp_engine_run(*case) for case in WIDE]


@pytest.mark.parametrize("index", range(len(WIDE)), ids=[_case_id(c) for c in WIDE])
def test_context_parallel_with_data_parallel_equals_reference(wide_runs, index):
    pipeline, layout = WIDE[index]
    results = [rank[index] for rank in wide_runs]
    ref = _reference(layout["packed"], 2, layout["steps"])
    assert_matches_reference(results, ref)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-5
        assert r["train_batch_size"] == 2 * GAS * 2 * 2
    print(_case_id(WIDE[index]), "dp2 losses", ref["losses"])


@pytest.fixture(scope="module")
def wide_runs():
    return run_ranks(2 * WORLD, wide_cases, timeout=1500)
