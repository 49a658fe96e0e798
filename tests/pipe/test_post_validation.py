"""Optimizer post-validation ("pipeline.post_validation") changes nothing but the timing: with it on
and off (same ds_config otherwise), 4 steps give the same weights (1e-6; in practice bit-equal), losses,
grad norms, skipped steps, loss scales and lr schedule. fp32 under zbv and 1f1b at PP=2 in three
situations: clipping never triggers, it triggers on step 2, an inf lands in one rank's gradient on
step 3. Both situations in one run for zbv in bf16, in fp16 (dynamic loss scale; DeepSpeed's CPU refusal
patched out), with vocabulary parallelism under zbv and 1f1b, and at PP=2 x DP=2; the inf situation also at
PP=4 under zbv. zbv runs step early on every
rank (`shortcuts` off), so every rank rolls back; 1f1b runs keep the shortcuts, so ranks whose own
gradients show the clip or the inf step once, in DeepSpeed's order."""
import math

import torch

from tests.gpt_harness import ds_config, layer_key, micro_batch, optimizer_for, tiny_config
from megatron_ds.testing.launcher import run_ranks

STEPS, GAS, LR = 4, 4, 0.1
# Unclipped global grad norms of the 4 steps (lr 0.1 overshoots on step 1): about 1.21, 1.41, 0.94, 0.86 at
# PP=2 (one replica, 4 micro-batches), 0.83, 1.27, 1.01, 0.67 at PP2xDP2 (8 micro-batches). These clips
# trigger on step 2 only; 10 never does.
CLIP_STEP2 = {1: 1.3, 2: 1.15}  # by DP size
CLIP_NEVER = 10.0
INF_STEP, INF_RANK = 2, 1  # 0-based step, global rank
# fp16 with a dynamic loss scale that grows after every good step but the first and halves on an overflow.
FP16 = {"initial_scale_power": 12, "loss_scale_window": 1, "hysteresis": 1}


def _inject_inf(engine_cls):
    """Before ReduceGrads, an engine whose `_inf_at_step` is its step puts one inf into a gradient."""
    from deepspeed.runtime.pipe.schedule import ReduceGrads
    original = engine_cls._INSTRUCTION_MAP[ReduceGrads]
    if getattr(original, "_injects_inf", False):
        return

    def injecting(self, *args, **kwargs):
        if getattr(self, "_inf_at_step", None) == self.global_steps:
            # Not a pipe-replicated copy of a tied weight: DeepSpeed leaves those out of the norm.
            grad = next(p.grad for p in self.module.parameters()
                        if p.grad is not None and not getattr(p, "ds_pipe_replicated", False))
            grad.view(-1)[0] = math.inf
        return original(self, *args, **kwargs)

    injecting._injects_inf = True
    engine_cls._INSTRUCTION_MAP = {**engine_cls._INSTRUCTION_MAP, ReduceGrads: injecting}


def run_case(pp, schedule, post_validation, clip, inf=False, bf16=False, shortcuts=True, lr=LR, fp16=None,
             layers=4, vocab_parallel=False):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.engine import ScheduleEngine
    config = tiny_config(layers)
    dp = dist.get_world_size() // pp
    cfg = ds_config(pp, dp, GAS, clip=clip, bf16=bf16, lr=lr,
                    pipeline={"schedule": schedule, "post_validation": post_validation,
                              **({"vocab_parallel": True} if vocab_parallel else {})})
    if fp16 is not None:
        # DeepSpeed refuses fp16 on CPU only because the accelerator says so; ZeRO-1 fp16 itself runs.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
        cfg["fp16"] = {"enabled": True, **fp16}
    module = build_pipeline_module(config, cfg, pp)
    optimizer = optimizer_for(module.named_parameters(), lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    engine = initialize_engine(module, cfg, optimizer=optimizer, lr_scheduler=scheduler)
    _inject_inf(ScheduleEngine)
    if inf and dist.get_rank() == INF_RANK:
        engine._inf_at_step = INF_STEP
    if post_validation:
        engine._post_validation.shortcuts = shortcuts
        assert "step" not in vars(engine.optimizer), "the ZeRO optimizer stays as DeepSpeed built it"
    dp_rank = engine.grid.get_data_parallel_rank()
    losses, norms, lrs, skipped, scales = [], [], [], [], []
    for step in range(STEPS):
        batches = iter([micro_batch(step, dp_rank * GAS + j, config.vocab_size) for j in range(GAS)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
        lrs.append(engine.get_lr()[0])
        skipped.append(engine.skipped_steps)
        scales.append(engine.optimizer.loss_scale)
    weights = {layer_key(module, n): p.detach().float().clone() for n, p in module.named_parameters()}
    counts = dict(engine._post_validation.counts) if post_validation else None
    return dict(losses=losses, norms=norms, lrs=lrs, skipped=skipped, scales=scales, weights=weights,
                counts=counts)


def refusal(pp):
    """The message for bf16 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer)."""
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.plan.config import ConfigError
    cfg = ds_config(pp, 1, GAS, bf16=True, pipeline={"schedule": "zbv", "post_validation": True})
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    module = build_pipeline_module(tiny_config(4), cfg, pp)
    try:
        initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters()))
    except ConfigError as exc:
        return str(exc)
    return None


def rank_cases(pp, cases, check_refusal=False):
    """run_case of each case at pipeline size `pp` (a case's own "pp" wins)."""
    results = [run_case(**dict({"pp": pp}, **case)) for case in cases]
    return results + [refusal(pp)] if check_refusal else results


def _pairs(schedule, shortcuts, dp=1, combined=False, **kw):
    """(off, on) cases for the three situations, or one with the clip on step 2 and the inf on step 3."""
    situations = [(CLIP_STEP2[dp], True)] if combined else [(CLIP_NEVER, False), (CLIP_STEP2[dp], False),
                                                            (CLIP_NEVER, True)]
    return [dict(schedule=schedule, post_validation=pv, clip=clip, inf=inf, shortcuts=shortcuts, **kw)
            for clip, inf in situations for pv in (False, True)]


def _compare(per_rank, cases, atol):
    """Max abs weight difference of each (off, on) pair; asserts everything else is equal."""
    diffs = []
    for i in range(0, len(cases), 2):
        name = {k: v for k, v in cases[i + 1].items() if k != "post_validation"}
        worst = 0.0
        for rank in per_rank:
            off, on = rank[i], rank[i + 1]
            assert on["losses"] == off["losses"], (name, off["losses"], on["losses"])
            assert on["norms"] == off["norms"], (name, off["norms"], on["norms"])
            assert on["lrs"] == off["lrs"], (name, off["lrs"], on["lrs"])
            assert on["skipped"] == off["skipped"], (name, off["skipped"], on["skipped"])
            assert on["scales"] == off["scales"], (name, off["scales"], on["scales"])
            assert on["weights"].keys() == off["weights"].keys()
            for key, w in off["weights"].items():
                worst = max(worst, (on["weights"][key] - w).abs().max().item())
        assert worst <= atol, (name, worst)
        expect_skips = [0, 0, 1, 1] if cases[i]["inf"] else [0] * STEPS
        assert per_rank[0][i]["skipped"] == expect_skips, (name, per_rank[0][i]["skipped"])
        norms, clip = per_rank[0][i]["norms"], cases[i]["clip"]
        assert math.isinf(norms[INF_STEP]) == cases[i]["inf"], (name, norms)
        clipped = [math.isfinite(n) and n > clip for n in norms]
        assert clipped == ([False, True, False, False] if clip != CLIP_NEVER else [False] * STEPS), (name, norms)
        if cases[i].get("fp16"):
            assert len(set(per_rank[0][i]["scales"])) > 1, (name, per_rank[0][i]["scales"])  # the scale moved
        diffs.append((name, worst))
    return diffs


def _counts(per_rank, cases):
    total = {}
    for rank in per_rank:
        for result in rank:
            for k, v in (result["counts"] or {}).items():
                total[k] = total.get(k, 0) + v
    return total


def test_post_validation_changes_only_timing_at_pp2():
    cases = _pairs("zbv", shortcuts=False) + _pairs("1f1b", shortcuts=True)
    cases += _pairs("zbv", shortcuts=False, combined=True, bf16=True)
    cases += _pairs("zbv", shortcuts=False, combined=True, fp16=FP16)
    cases += _pairs("zbv", shortcuts=False, combined=True, vocab_parallel=True)  # the slices' norm and rollback
    cases += _pairs("1f1b", shortcuts=True, combined=True, vocab_parallel=True)
    per_rank = run_ranks(2, rank_cases, 2, cases, check_refusal=True, timeout=900)
    for rank in per_rank:
        message = rank.pop()
        assert message and "pipeline.post_validation" in message and "BF16_Optimizer" in message, message
    for name, worst in _compare(per_rank, cases, atol=1e-6):
        print(f"{name}: max abs weight difference {worst:.3g}")
    total = _counts(per_rank, cases)
    print("post-validation paths over all ranks and runs:", total)
    assert total["redone"] > 0 and total["rolled_back_skipped"] > 0, total
    assert total["skipped"] > total["rolled_back_skipped"], total  # some rank skipped without stepping early


def test_post_validation_changes_only_timing_at_pp2_dp2_and_a_pp4_inf_rolls_back_every_rank():
    """One launch of 4 ranks: PP=2 x DP=2 (clip on step 2, inf on step 3), then four stages (zbv: 8 chunks,
    two per rank) where the inf on one rank is seen by all and every rank rolls back."""
    dp2 = _pairs("zbv", shortcuts=False, dp=2, combined=True)
    pp4 = [dict(schedule="zbv", post_validation=pv, clip=CLIP_NEVER, inf=True, shortcuts=False, layers=8, pp=4)
           for pv in (False, True)]
    per_rank = run_ranks(4, rank_cases, 2, dp2 + pp4, timeout=900)
    for name, worst in _compare([r[:len(dp2)] for r in per_rank], dp2, atol=1e-6):
        print(f"PP=2 x DP=2 {name}: max abs weight difference {worst:.3g}")
    pp4_results = [r[len(dp2):] for r in per_rank]
    for name, worst in _compare(pp4_results, pp4, atol=1e-6):
        print(f"PP=4 {name}: max abs weight difference {worst:.3g}")
    total = _counts(pp4_results, pp4)
    assert total["rolled_back_skipped"] == 4, total  # every rank stepped early on the inf step, then undid it
