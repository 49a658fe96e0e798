"""--loss-chunk-size on the pipeline engines equals the single-process reference (whole logits): loss,
gradients, 3-step weights and eval loss within 1e-5, at PP=2, for a tied GPT-2 head (DeepSpeed's tied
copy) and an untied LLaMA-style head, under 1f1b, zb-h1 (the head's weight gradient deferred to W),
seq1f1b k=2 + B/W split (each segment's loss over the micro-batch's tokens), and for the LLaMA head zb-h1
with compiled layers (the arithmetic between the chunks' GEMMs compiled too). One launch."""
from tests.gpt_harness import assert_matches_reference, engine_rank_runs, reference_run, tiny_config

LAYERS, STEPS, GAS, CHUNK = 4, 3, 2, 7  # 7 divides neither a segment's 2 x 8 nor a sequence's 2 x 16 tokens
LR = 1e-3  # compiled kernels round apart by ~1e-7, which Adam at 1e-2 can turn into 1e-5 (test_compile_engine.py)
MODELS = {"gpt2-tied": dict(loss_chunk_size=CHUNK),
          "llama-untied": dict(loss_chunk_size=CHUNK, normalization="rmsnorm", swiglu=True,
                               position_embedding_type="rope", num_key_value_heads=2,
                               untie_embeddings_and_output_weights=True, add_bias_linear=False)}
PIPELINES = [{"schedule": "1f1b"}, {"schedule": "zb-h1"},
             {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True}]
COMPILED = {"llama-untied": [{"schedule": "zb-h1", "compile_layers": True}]}  # compiling takes the most time


def pipelines(name):
    return PIPELINES + COMPILED.get(name, [])


def both_models(pp, gas, steps):
    return {name: engine_rank_runs(pp, gas, steps, pipelines(name), num_layers=LAYERS, model=model, lr=LR)
            for name, model in MODELS.items()}


def test_chunked_loss_matches_whole_logits_reference():
    from megatron_ds.testing.launcher import run_ranks
    per_rank = run_ranks(2, both_models, 2, GAS, STEPS, timeout=900)
    for name, model in MODELS.items():
        ref = reference_run(tiny_config(LAYERS, **model), 1, GAS, STEPS, lr=LR)
        for i, pipeline in enumerate(pipelines(name)):
            try:
                assert_matches_reference([r[name][i] for r in per_rank], ref)
            except AssertionError as exc:
                raise AssertionError(f"{name} {pipeline}: {exc}") from None
