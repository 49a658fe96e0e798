"""On CUDA: the compiled layers ("pipeline.compile_layers") and the compiled layers replayed as CUDA
graphs ("pipeline.cuda_graphs") equal the eager engine at PP=1, fp32 with TF32 off: the losses of 3
steps and every weight after them within 1e-5, under 1f1b (whole backward), zb-h1 (B/W split, deferred W)
and seq1f1b k=4 with the split (segments through the K/V cache). The CPU suite checks the compiled
layers at PP=2 and PP2xDP2 (test_compile_engine.py); what only a GPU shows is inductor's CUDA code and
the graph replay. One spawned process (NCCL, one rank); skipped without CUDA."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PIPELINES = {"1f1b": {"schedule": "1f1b"}, "zb-h1": {"schedule": "zb-h1"},
             "seq1f1b-k4-bw": {"schedule": "seq1f1b", "seq_splits": 4, "split_backward": True}}
VARIANTS = ("on", "graphs")
STEPS = 3


def differences_from_eager(steps):
    """{(schedule, variant): (largest loss difference, largest weight difference)} against the eager run."""
    import torch
    from bench import gpu_step
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu_step.init_process_group()
    config = gpu_step.model_config(True, 64)
    shape = gpu_step.Shape(64, 2, 8)
    out = {}
    for name, pipeline in PIPELINES.items():
        runs = {}
        for variant in ("off", *VARIANTS):
            step, engine = gpu_step.engine_step(pipeline, variant, config, shape, bf16=False)
            losses = [step(i) for i in range(steps)]
            weights = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
            runs[variant] = losses, weights
            del step, engine
        eager_losses, eager_weights = runs["off"]
        for variant in VARIANTS:
            losses, weights = runs[variant]
            assert weights.keys() == eager_weights.keys(), (name, variant)
            out[(name, variant)] = (max(abs(a - b) for a, b in zip(losses, eager_losses)),
                                    max((weights[n] - eager_weights[n]).abs().max().item() for n in weights))
    return out


def test_compiled_and_graphed_layers_equal_eager_on_cuda():
    from megatron_ds.testing.launcher import run_ranks
    differences = run_ranks(1, differences_from_eager, STEPS, timeout=900)[0]
    assert set(differences) == {(p, v) for p in PIPELINES for v in VARIANTS}
    for case, (loss, weight) in differences.items():
        assert loss < 1e-5 and weight < 1e-5, (case, loss, weight)
