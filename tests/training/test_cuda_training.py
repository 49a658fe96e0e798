"""Training on a CUDA GPU (skipped without one): torch's fused AdamW is what build_optimizer gives and it
steps as the unfused one does; pretrain_gpt.py on one GPU initialises NCCL by default and trains in bf16
(ZeRO-1, fused AdamW, flash attention) with the loss going down."""
import json
import types

import pytest
import torch

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.training.model_setup import build_optimizer
from tests.training.test_resume import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# eps well above sqrt(v): the kernels round m / (sqrt(v) + eps) differently where v is tiny (with
# eps 1e-8, 6 % of the elements differed by over 1e-7, one by 1 % of a step), so compare away from that
ADAM = types.SimpleNamespace(optimizer="adam", lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-3,
                             weight_decay=0.1)


def test_build_optimizer_gives_fused_adamw_that_steps_as_the_unfused_one():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).cuda()
    twin.load_state_dict(module.state_dict())
    twin_start = {n: p.detach().clone() for n, p in twin.named_parameters()}
    fused = build_optimizer(module, ADAM)
    try:
        import apex.optimizers  # noqa: F401 - with NVIDIA apex, FusedAdam is chosen instead
        pytest.skip("NVIDIA apex is installed")
    except ImportError:
        pass
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"]
    linear, norm = twin
    plain = torch.optim.AdamW([{"params": [linear.weight], "weight_decay": 0.1},  # build_optimizer's groups
                               {"params": [linear.bias, norm.weight, norm.bias], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95), eps=1e-3, foreach=False)
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        for m, opt in ((module, fused), (twin, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(module.named_parameters(), twin.parameters()):
        step, diff = (b - twin_start[name]).abs().max().item(), (a - b).abs().max().item()
        assert step > 1e-5 and diff < 1e-6, (name, step, diff)  # H100: steps 7e-5 and up, diff 7e-9


def bf16_config(tmp_path, name, pipeline=None):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                                "gradient_clipping": 1.0, **({"pipeline": pipeline} if pipeline else {})}))
    return path


def test_pretrain_on_one_gpu_nccl_bf16(tmp_path):
    """DeepSpeed's engine and ours running Seq1F1B (2 segments through the K/V cache, B/W split) on
    one GPU: both go down, and ours follows DeepSpeed's within bf16's noise."""
    write_corpus(str(tmp_path / "corpus"))
    runs = {}
    for name, pipeline in (("stock", None), ("seq1f1b", {"schedule": "seq1f1b", "seq_splits": 2,
                                                         "split_backward": True})):
        records, out = launch(tmp_path, name, "--pipeline-model-parallel-size", "1", "--train-iters", "30",
                              "--eval-interval", "10", nproc=1, ds_config=bf16_config(tmp_path, name, pipeline),
                              hard=("--hidden-dropout", "0", "--attention-dropout", "0"))
        assert "> torch.distributed: backend nccl, world size 1" in out, out[-3000:]
        runs[name] = [r["loss"] for r in records if "loss" in r]
        assert len(runs[name]) == 30 and sum(runs[name][-5:]) / 5 < runs[name][0] - 1.0, runs[name]
    assert "schedule seq1f1b" in out and "ScheduleEngine" in out
    worst = max(abs(a - b) for a, b in zip(runs["stock"], runs["seq1f1b"]))
    assert worst < 0.05, (worst, runs)
