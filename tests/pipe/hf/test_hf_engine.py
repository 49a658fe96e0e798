"""A transformers causal LM cut by megatron_ds.pipe.hf and run by megatron_ds.initialize equals the same
transformers model trained on one process (tests/hf_harness.py): every step's loss, the first step's gradients
and the weights after 3 AdamW steps within 1e-5 (fp32, dropout 0), by the model's own parameter names. LLaMA
(tied embeddings) under 1f1b, zbv, bitpipe and dualpipev and with packed documents; Qwen3, Mistral (a sliding
window that bites), Gemma 3 (sliding layers with their own rotary, capped logits), Phi-3, OLMo 2 and Mixtral
(MoE) under 1f1b or zbv, at PP 2; PP 2 x DP 2 with ZeRO-1 and with packed documents. One launch per layout."""
import pytest

from megatron_ds.testing.launcher import run_ranks
from tests.hf_harness import assert_matches, rank_runs, reference_run

GAS = 4
SPLIT = {"zbv", "dualpipev"}
LAYOUTS = {  # world, pp, [(family, pipeline section, ZeRO stage, packed documents)]
    "pp2": (2, 2, [("llama", {"schedule": s}, 0, False) for s in ("1f1b", "zbv", "bitpipe", "dualpipev")] + [
        ("llama", {"schedule": "zbv"}, 0, True), ("qwen3", {"schedule": "zbv"}, 0, False),
        ("mistral", {"schedule": "1f1b"}, 0, True), ("gemma3", {"schedule": "zbv"}, 0, True),
        ("phi3", {"schedule": "1f1b"}, 0, False), ("olmo2", {"schedule": "zbv"}, 0, False),
        ("mixtral", {"schedule": "zbv"}, 0, False)]),
    "pp2xdp2": (4, 2, [("llama", {"schedule": "zbv"}, 1, False), ("llama", {"schedule": "1f1b"}, 0, True)]),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def launched(request):
    world, pp, cases = LAYOUTS[request.param]
    return request.param, cases, run_ranks(world, rank_runs, pp, GAS, cases, timeout=900, quiet=True)


def test_hf_models_train_as_on_one_process(launched):
    layout, cases, per_rank = launched
    dp = len(per_rank) // LAYOUTS[layout][1]
    refs = {}
    for i, (family, pipeline, zero, packed) in enumerate(cases):
        ref = refs.setdefault((family, packed), reference_run(family, dp * GAS, packed=packed))
        results = [r[i] for r in per_rank]
        try:
            assert_matches(results, ref)
        except AssertionError as exc:
            raise AssertionError(f"{layout} {family} {pipeline} zero={zero} packed={packed}: {exc}") from None
        assert {r["engine"] for r in results} == {"ForeignScheduleEngine"}
        assert (zero == 0) == all(r["grads"] is not None for r in results)
        # the split schedules take the weight gradients in W ops (autograd's split), the others in the backward
        assert (sum(r["in_w"] for r in results) > 0) == (pipeline["schedule"] in SPLIT), (family, pipeline)
