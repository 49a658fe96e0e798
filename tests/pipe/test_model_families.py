"""Tiny LLaMA-style and BLOOM-style models on ScheduleEngine equal the single-process reference
(fp32, 1e-5: losses, every first-step gradient, weights after the steps, eval loss) under every
schedule at PP=2 (Seq1F1B with the B/W split) and ZB-V at PP=2 x DP=2; BitPipe's twin copies stay
bit-identical; the LLaMA run's first loss equals Hugging Face's LlamaForCausalLM on the same batch.
One launch per topology runs every (family, schedule)."""
import pytest
import torch

from megatron_ds.model import GPTModel, LMHead, gpt_layer_specs
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (assert_matches_reference, engine_rank_run, micro_batch, reference_run,
                               tiny_config)

STEPS, GAS, LAYERS = 2, 4, 4
LR = 1e-3  # Seq1F1B's segment-wise gradients differ in summation order; see test_seq1f1b.py
FAMILIES = {
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", num_key_value_heads=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False, ffn_hidden_size=48,
                  layernorm_epsilon=1e-6),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
}
PP2 = [{"schedule": "1f1b"}, {"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zb-h1"},
       {"schedule": "zb-h2"}, {"schedule": "zbv"}, {"schedule": "bitpipe"},
       {"schedule": "seq1f1b", "seq_splits": 2, "seq_split_method": "even", "split_backward": True}]
TOPOLOGIES = {"pp2": (2, 1, PP2), "pp2xdp2": (2, 2, [{"schedule": "zbv"}])}


def family_rank_runs(pp, cases):
    return [engine_rank_run(pp, GAS, STEPS, pipeline, num_layers=LAYERS, lr=LR, model=FAMILIES[family])
            for family, pipeline in cases]


def hf_first_loss(config, dp):
    """HF LlamaForCausalLM's mean loss over step 0's micro-batches, from our initial weights."""
    transformers = pytest.importorskip("transformers")
    from megatron_ds.convert.hf import hf_config_from_gpt, to_hf_state_dict
    ours = GPTModel(config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config_from_gpt(config)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.named_parameters_by_layer(), config), strict=True)
    losses = []
    with torch.no_grad():
        for i in range(dp * GAS):
            (x, _), y = micro_batch(0, i, config.vocab_size, config.max_position_embeddings)
            sequence = torch.cat([x, y[:, -1:]], dim=1)  # HF shifts the labels itself
            losses.append(hf(sequence, labels=sequence).loss.item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_families_match_reference_under_every_schedule(name):
    pp, dp, pipelines = TOPOLOGIES[name]
    cases = [(family, pipeline) for family in FAMILIES for pipeline in pipelines]
    per_rank = run_ranks(pp * dp, family_rank_runs, pp, cases, timeout=900)
    refs = {f: reference_run(tiny_config(LAYERS, **FAMILIES[f]), dp, GAS, STEPS, lr=LR) for f in FAMILIES}
    for i, (family, pipeline) in enumerate(cases):
        results = [r[i] for r in per_rank]
        try:
            assert_matches_reference(results, refs[family])
        except AssertionError as exc:
            raise AssertionError(f"{family} {pipeline}: {exc}") from None
        if pipeline["schedule"] == "bitpipe":  # both replicas' copies of every layer, bit for bit
            for key in refs[family]["weights"]:
                copies = [r["weights"][key] for r in results if key in r["weights"] and r["dp_rank"] == 0]
                assert len(copies) >= 2 and all(torch.equal(copies[0], c) for c in copies[1:]), (family, key)
    hf_loss = hf_first_loss(tiny_config(LAYERS, **FAMILIES["llama"]), dp)
    first = cases.index(("llama", pipelines[0]))
    assert abs(per_rank[0][first]["losses"][0] - hf_loss) <= 1e-5, (per_rank[0][first]["losses"][0], hf_loss)


def test_untied_head_is_its_own_pipeline_layer():
    from deepspeed.pipe import TiedLayerSpec
    config = tiny_config(LAYERS, **FAMILIES["llama"])
    specs = gpt_layer_specs(config)
    assert not any(isinstance(s, TiedLayerSpec) for s in specs)  # no tied-weight all-reduce
    assert specs[-1].typename is LMHead and specs[-1].module_args[-1] == LAYERS + 2
    keys = GPTModel(config).named_parameters_by_layer()
    assert (LAYERS + 2, "weight") in keys and (0, "wpe.weight") not in keys
