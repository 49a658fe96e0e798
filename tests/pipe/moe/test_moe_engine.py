"""A mixture-of-experts GPT on the pipeline engines equals the single-process reference (fp32, 1e-5:
losses, every first-step gradient, weights and expert biases after 3 steps, eval loss) under every schedule
and DeepSpeed's stock engine, at PP=2 and PP=2 x DP=2, without expert parallelism: the router losses enter
the gradient once per token, scaled as the LM loss (Seq1F1B's segments weighed by their whole micro-batch's
counts, activation checkpointing's recomputation counted once), and the expert bias moves by the whole
batch's counts."""
import dataclasses

import pytest

from megatron_ds.moe_config import MoEConfig
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config

STEPS, GAS, LAYERS = 3, 4, 4
LR = 1e-3
MODELS = {
    # 8 experts, top-2, a shared expert, aux loss and z-loss (Mixtral / Qwen-style softmax routing)
    "softmax": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, ffn_hidden_size=24,
                    moe=MoEConfig(num_experts=8, router_topk=2, shared_expert_intermediate_size=16,
                                  aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    # sigmoid scores, DeepSeek-V3's expert bias, the first layer dense
    "sigmoid": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                    ffn_hidden_size=24,
                    moe=MoEConfig(num_experts=8, router_topk=2, score_function="sigmoid", enable_expert_bias=True,
                                  bias_update_rate=0.01, layer_freq=(0, 1, 1, 1), aux_loss_coeff=0.01)),
    # a capacity factor: each full expert drops its lowest-probability tokens, the same ones as one process
    "capacity": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                     ffn_hidden_size=24, moe=MoEConfig(num_experts=4, router_topk=2, capacity_factor=1.0,
                                                       aux_loss_coeff=0.01)),
    # the balancing loss per sequence, which Seq1F1B's segments cut through
    "seq_aux": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                    ffn_hidden_size=24, moe=MoEConfig(num_experts=4, router_topk=2, load_balancing_type="seq_aux_loss",
                                                      aux_loss_coeff=0.05, z_loss_coeff=0.01)),
}
# the softmax model's experts as grouped GEMMs (--moe-grouped-gemm; on CPU bit-equal to the loop)
MODELS["grouped"] = {**MODELS["softmax"], "moe": dataclasses.replace(MODELS["softmax"]["moe"], grouped_gemm=True)}
SEQ1F1B = {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}
PP2 = [None, {"schedule": "1f1b"}, {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zb-h1"},
       {"schedule": "zbv"}, {"schedule": "bitpipe"}, {"schedule": "dualpipev"},
       {"schedule": "1f1b", "activation_checkpoint_interval": 1}, SEQ1F1B,
       {**SEQ1F1B, "activation_checkpoint_interval": 1}]
OTHERS = [{"schedule": "zb-h1", "vocab_parallel": True}, {"schedule": "zbv", "post_validation": True},
          {"schedule": "zb-h1", "compile_layers": True}]
EVERY = PP2[:7] + [SEQ1F1B]  # the stock engine and every named schedule
# name: (pp, dp, layers, cases): PP 4 holds 8 layers (the V schedules put two chunks on each rank)
TOPOLOGIES = {"pp2": (2, 1, LAYERS, [("softmax", p) for p in PP2 + OTHERS]
                      + [("sigmoid", p) for p in PP2[:2] + PP2[3:5] + PP2[-2:]]
                      + [("seq_aux", p) for p in (PP2[1], SEQ1F1B, {**SEQ1F1B, "seq_splits": 4})]
                      + [("capacity", p) for p in (None, {"schedule": "zbv"}, {"schedule": "bitpipe"})]),
              "pp2xdp2": (2, 2, LAYERS, [("softmax", p) for p in EVERY] + [("sigmoid", {"schedule": "zb-h1"}),
                                                                           ("sigmoid", None)]),
              "pp4": (4, 1, 8, [("softmax", p) for p in EVERY])}


def moe_rank_runs(pp, layers, cases):
    return [engine_rank_run(pp, GAS, STEPS, pipeline, num_layers=layers, lr=LR, model=MODELS[model])
            for model, pipeline in cases]


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_moe_matches_reference_under_every_schedule(name):
    pp, dp, layers, cases = TOPOLOGIES[name]
    per_rank = run_ranks(pp * dp, moe_rank_runs, pp, layers, cases, timeout=1200)
    used = {m for m, _ in cases}
    refs = {m: reference_run(tiny_config(layers, **MODELS[m]), dp, GAS, STEPS, lr=LR) for m in used}
    for m in used:
        biases = [k for k in refs[m]["weights"] if str(k[1]).endswith("expert_bias")]
        assert bool(biases) == MODELS[m]["moe"].enable_expert_bias
        assert all(refs[m]["weights"][k].abs().sum() > 0 for k in biases), "the expert bias never moved"
    for i, (model, pipeline) in enumerate(cases):
        results = [r[i] for r in per_rank]
        try:
            assert_matches_reference(results, refs[model])
        except AssertionError as exc:
            raise AssertionError(f"{model} {pipeline}: {exc}") from None
        for key in refs[model]["weights"]:
            assert any(key in r["weights"] for r in results), (model, pipeline, key)
        metrics = [r["engine"]["router_metrics"] for r in results]  # the last step's, for the log line
        assert all(m == metrics[0] for m in metrics), "ranks disagree on the router metrics"
        moe_layers = [i for i in range(1, layers + 1) if tiny_config(layers, **MODELS[model]).is_moe_layer(i)]
        assert sorted(metrics[0]["expert_load"]) == moe_layers and metrics[0]["load_balancing_loss"] > 0


EP_CASES = [None, {"schedule": "1f1b"}, {"schedule": "zb-h1"}, {"schedule": "zbv"}, {"schedule": "dualpipev"},
            {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "bitpipe"}, SEQ1F1B,
            {**SEQ1F1B, "activation_checkpoint_interval": 1}]


def with_expert_parallel(model, ep):
    return {**MODELS[model], "moe": dataclasses.replace(MODELS[model]["moe"], expert_model_parallel_size=ep)}


def ep_rank_runs(pp, ep, cases):
    return [engine_rank_run(pp, GAS, STEPS, pipeline, num_layers=LAYERS, lr=LR, model=with_expert_parallel(model, ep))
            for model, pipeline in cases]


def assert_expert_parallel_matches(results, ref, dp, atol=1e-5, tp=1):
    """As assert_matches_reference, but an expert's gradient lives on the EP ranks that hold it: each one's
    local gradient sums the tokens of its whole EP group, and their sum over the DP ranks holding it,
    divided by the DP size, is the data-parallel mean (with TP, each TP rank holds that sum: the same tokens,
    or under SP its shard's, summed over the TP ranks before ZeRO reduces). The gradient norm, which
    clipping divides by, counts every expert once."""
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= atol, (r["losses"], ref["losses"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= atol, ("eval loss", r["eval_loss"], ref["eval_loss"])
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), (r["grad_norms"], ref["grad_norms"])
    for key, ref_grad in ref["grads"].items():
        copies = {}  # pipeline rank -> the ranks holding its copy (BitPipe's twins: two pipeline ranks)
        for r in results:
            if key in r["grads"]:
                copies.setdefault(r["engine"]["stage"], []).append(r["grads"][key])
        assert copies, key
        for stage, grads in copies.items():
            got = sum(grads) / (dp * tp if ".experts." in str(key[1]) else len(grads))
            diff = (got - ref_grad).abs().max().item()
            assert diff <= atol, f"gradient of {key} (pipeline rank {stage}): max abs diff {diff:.3g}"
    for key, w in ref["weights"].items():
        holders = [r for r in results if key in r["weights"]]
        assert holders, key
        for r in holders:
            diff = (r["weights"][key] - w).abs().max().item()
            assert diff <= atol, f"weight {key} after {len(ref['losses'])} steps: max abs diff {diff:.3g}"


@pytest.mark.parametrize("pp, dp, ep", [(2, 2, 2), (1, 4, 4)])
def test_expert_parallel_matches_reference(pp, dp, ep):
    """The experts split over EP ranks of each stage's data-parallel ranks, tokens dispatched by all-to-all,
    ZeRO-1 reducing them over their expert-data-parallel group (DeepSpeed's MoE groups)."""
    cases = [("softmax", p) for p in (EP_CASES if pp > 1 else [None, {"schedule": "1f1b"}])] \
        + [("sigmoid", {"schedule": "zb-h1"}), ("grouped", {"schedule": "zb-h1"}),
           ("capacity", {"schedule": "zbv" if pp > 1 else "1f1b"})]
    per_rank = run_ranks(pp * dp, ep_rank_runs, pp, ep, cases, timeout=900)
    refs = {m: reference_run(tiny_config(LAYERS, **MODELS[m]), dp, GAS, STEPS, lr=LR) for m in {m for m, _ in cases}}
    for i, (model, pipeline) in enumerate(cases):
        results = [r[i] for r in per_rank]
        experts = {k for r in results for k in r["weights"] if ".experts." in str(k[1])}
        assert all(sum(k in r["weights"] for k in experts) < len(experts) for r in results), "no rank split its experts"
        try:
            assert_expert_parallel_matches(results, refs[model], dp)
        except AssertionError as exc:
            raise AssertionError(f"EP {ep} {model} {pipeline}: {exc}") from None


TP_CASES = [("softmax", None, False), ("softmax", {"schedule": "1f1b"}, False), ("sigmoid", {"schedule": "zbv"}, False),
            ("softmax", {"schedule": "zb-h1"}, True), ("seq_aux", SEQ1F1B, True)]


def tp_rank_runs(cases):
    return [engine_rank_run(2, GAS, STEPS, pipeline, num_layers=LAYERS, lr=LR,
                            model={**MODELS[model], "tensor_model_parallel_size": 2, "sequence_parallel": sp})
            for model, pipeline, sp in cases]


def test_moe_with_tensor_parallelism_matches_reference():
    """TP splits attention, the dense MLPs and the shared expert; the router and the experts stay whole on each
    TP rank, which routes the same tokens (or, with sequence parallelism, its shard of them)."""
    per_rank = run_ranks(4, tp_rank_runs, TP_CASES, timeout=900)
    refs = {m: reference_run(tiny_config(LAYERS, **MODELS[m]), 1, GAS, STEPS, lr=LR) for m in MODELS}
    failures = []
    for i, (model, pipeline, sp) in enumerate(TP_CASES):
        try:
            assert_matches_reference([r[i] for r in per_rank], refs[model])
        except AssertionError as exc:
            failures.append(f"TP2 {model} {pipeline} sp={sp}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


CLIP = 0.05  # below every step's gradient norm here: clipping divides by the norm
# every schedule, half of them with SP, a third clipped; and the sigmoid router with its expert bias
EP_TP_CASES = [("softmax", p, i % 2 == 1, CLIP if i % 3 == 0 else 0.0) for i, p in enumerate(EVERY)] \
    + [("sigmoid", {"schedule": "zbv"}, True, CLIP)]


def ep_tp_rank_runs(cases):
    return [engine_rank_run(2, GAS, STEPS, pipeline, num_layers=LAYERS, lr=LR, clip=clip,
                            model={**with_expert_parallel(model, 2), "tensor_model_parallel_size": 2,
                                   "sequence_parallel": sp})
            for model, pipeline, sp, clip in cases]


def test_expert_parallel_with_tensor_parallelism_matches_reference():
    """TP 2 x PP 2 x DP 2 with EP 2: each TP rank's data-parallel ranks form its EP groups (the same experts on
    both TP ranks of a DP rank), with and without SP, with gradient clipping."""
    per_rank = run_ranks(8, ep_tp_rank_runs, EP_TP_CASES, timeout=1500)
    failures = []
    for i, (model, pipeline, sp, clip) in enumerate(EP_TP_CASES):
        ref = reference_run(tiny_config(LAYERS, **MODELS[model]), 2, GAS, STEPS, clip=clip, lr=LR)
        assert not clip or min(ref["grad_norms"]) > clip, "clipping is not active"
        results = [r[i] for r in per_rank]
        try:
            assert_expert_parallel_matches(results, ref, 2, tp=2)
        except AssertionError as exc:
            failures.append(f"TP2 EP2 {model} {pipeline} sp={sp} clip={clip}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)
