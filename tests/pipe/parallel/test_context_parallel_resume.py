"""Checkpoints do not depend on context parallelism. A LLaMA-style GPT takes its first step at CP 1 x PP 2 and
saves; that checkpoint resumes at CP 2 x PP 2, takes the second step and saves again; that one resumes at CP 4 x PP 1,
at CP 1 x PP 2 x DP 2 and at CP 1 x PP 2, and, converted into a universal checkpoint (training/checkpoint/universal.py,
DeepSpeed's ds_to_universal), at CP 4 x PP 1 and CP 1 x PP 2 x DP 2 again. Every resumed run's step equals the
uninterrupted single-process run's (fp32, 1e-5: the step's loss, every weight after step 3, the eval loss at the
save), and right after each load the fp32 master weights and Adam's moments, whole and by parameter, equal the
saving run's bit for bit.

The layout a checkpoint records counts the data axis (DP x CP, what ZeRO-1's shards are cut over): the same data
axis loads the shards as saved ("deepspeed": CP 2 -> CP 1 x DP 2), another re-cuts them parameter by parameter
("by_name"); the universal folder holds whole parameters and loads under any layout ("universal"). The global
batch is the same samples in every layout: at DP 2 each replica takes half of the micro-batches, and every CP rank
of a replica reads them whole."""
import os

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, layer_key, micro_batch, optimizer_for, reference_run, tiny_config,
                               whole_tensors)
from tests.gpt_harness import ds_config as make_ds_config
from tests.pipe.parallel.test_context_parallel import LLAMA, LR, SEQ

GAS, LAYERS, STEPS = 4, 4, 3
SAVED, UNIVERSAL = "step2", "step2_universal"


def _engine(cp, pp, dp, universal=False):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(LAYERS, SEQ, **LLAMA, context_parallel_size=cp)
    cfg = make_ds_config(pp, dp, GAS // dp, pipeline={"schedule": "1f1b"}, lr=LR)
    if universal:  # what --universal-checkpoint sets
        cfg["checkpoint"] = {"load_universal": True}
    module = build_pipeline_module(config, cfg, pp)
    return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR)), config


def _batches(engine, config, step, cp):
    dp = engine.dp_world_size // cp
    gas, replica = GAS // dp, engine.grid.get_data_parallel_rank() // cp
    return iter([micro_batch(step, replica * gas + j, config.vocab_size, SEQ) for j in range(gas)])


def _zero_state(engine):
    """{layer key: {"fp32", "exp_avg", "exp_avg_sq"}}: this rank's parameters' ZeRO-1 state made whole (a collective
    over the data axis), keyed as the reference keys them, so that any layout compares."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron_ds.pipe.deepspeed.zero_internals import ZeroInternals
    adam = bool(engine.optimizer.optimizer.state)  # a fresh Adam has no moments: None
    if adam:  # DeepSpeed links the moments at its next step: a loaded (or first group's) state is linked now
        ZeroInternals(engine.optimizer).relink_hp_optimizer_states()
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    return {layer_key(engine.module, name): {"fp32": safe_get_full_fp32_param(p).clone(),
                                             **{k: safe_get_full_optimizer_state(p, k).clone() if adam else None
                                                for k in ("exp_avg", "exp_avg_sq")}}
            for name, p in engine.module.named_parameters()}


def leg(root, cp, pp, dp, load=None, save=None, universal=False):
    """One run at CP `cp` x PP `pp` x DP `dp`: load `load` as the loader's plan says (or start afresh), evaluate,
    take the steps up to `save` (a tag "stepN") or the third, and save there."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from megatron_ds.model.universal_info import universal_checkpoint_info
    from megatron_ds.pipe.engine import pipeline_layout, saved_layout
    from megatron_ds.training.checkpoint import engine as checkpoint_engine
    from megatron_ds.training.checkpoint.save_load import plan_load, read_saved_state, restore
    engine, config = _engine(cp, pp, dp, universal)
    out = dict(plan=None, loaded_state=None, steps_at_load=0)
    if load:
        plan = plan_load(saved_layout(read_saved_state(root, load)), pipeline_layout(engine), finetune=False,
                         no_load_optim=False, zero_stage=1, universal=universal)
        restore(engine, root, load, plan)
        out.update(plan=plan.optimizer, loaded_state=_zero_state(engine), steps_at_load=engine.global_steps)
    out["eval"] = float(engine.eval_batch(_batches(engine, config, EVAL_STEP, cp)))
    stop = int(save[len("step"):]) if save else STEPS
    out["losses"] = {step: float(engine.train_batch(_batches(engine, config, step, cp)))
                     for step in range(engine.global_steps, stop)}
    if save:
        out["saved_state"], out["eval_at_save"] = _zero_state(engine), float(engine.eval_batch(
            _batches(engine, config, EVAL_STEP, cp)))
        checkpoint_engine.install(engine)
        info = universal_checkpoint_info(config, config.vocab_size)  # as training/checkpoint/save_load.py saves
        engine.save_checkpoint(root, tag=save, client_state={UNIVERSAL_CHECKPOINT_INFO: info})
    out["weights"] = whole_tensors(engine, config, {layer_key(engine.module, n): p.detach()
                                                    for n, p in engine.module.named_parameters()})
    return out


def save_at_cp2_and_convert(root):
    """Resume the CP 1 step at CP 2, save the second step, convert it on rank 0 (DeepSpeed's converter, as
    `python -m megatron_ds.training.checkpoint.universal` runs it)."""
    import torch.distributed as dist
    from megatron_ds.training.checkpoint.universal import convert
    out = leg(root, cp=2, pp=2, dp=1, load="step1", save=SAVED)
    dist.barrier()
    if dist.get_rank() == 0:
        step = os.path.join(root, SAVED)
        assert convert(["--input_folder", step, "--output_folder", os.path.join(root, UNIVERSAL),
                        "--num_extract_workers", "1", "--num_merge_workers", "1"]) == 0
    dist.barrier()
    return out


def resume_twice(root, cp, pp, dp):
    """The CP 2 checkpoint resumed as saved and through its universal conversion, one engine after the other."""
    return {"plain": leg(root, cp, pp, dp, load=SAVED), "universal": leg(root, cp, pp, dp, load=UNIVERSAL,
                                                                         universal=True)}


def _whole(results, key):
    """{layer key: value} over every rank's part of the model (copies agree: each is compared)."""
    out = {}
    for r in results:
        for k, v in (r[key] or {}).items():
            out.setdefault(k, []).append(v)
    return out


def _assert_same_state(loaded, saved, what):
    """Every parameter's fp32 master and Adam moments after the load equal the saving run's, bit for bit."""
    saved, loaded = _whole(saved, "saved_state"), _whole(loaded, "loaded_state")
    assert set(loaded) == set(saved), (what, sorted(set(loaded) ^ set(saved), key=str))
    for key, copies in loaded.items():
        for copy in copies:
            for name, t in copy.items():
                assert t is not None, f"{what}: {key} has no {name} after the load"
                diff = (t - saved[key][0][name]).abs().max().item()
                assert diff == 0.0, f"{what}: {name} of {key} differs from the saved one by {diff:.3g}"


def _assert_continues(results, ref, step, what):
    """The step's loss, and after step 3 every weight, equal the uninterrupted single-process run's."""
    worst = max(abs(r["losses"][step] - ref["losses"][step]) for r in results)
    assert worst <= 1e-5, (what, step, [r["losses"][step] for r in results], ref["losses"][step])
    shown = f"{what}: step {step + 1}'s loss {results[0]['losses'][step]:.7f}, off the reference by {worst:.2e}"
    if step == STEPS - 1:
        weights = _whole(results, "weights")
        assert set(weights) == set(ref["weights"]), (what, sorted(set(weights) ^ set(ref["weights"]), key=str))
        diffs = {key: max((w - ref["weights"][key]).abs().max().item() for w in copies)
                 for key, copies in weights.items()}
        key = max(diffs, key=diffs.get)
        assert diffs[key] <= 1e-5, f"{what}: weight {key} after {STEPS} steps: max abs diff {diffs[key]:.3g}"
        shown += f"; every weight after step {STEPS} within {diffs[key]:.2e}"
    print(shown)


def test_checkpoints_resume_across_context_parallel_sizes_and_through_the_universal_checkpoint(tmp_path):
    root = str(tmp_path)
    ref = reference_run(tiny_config(LAYERS, SEQ, **LLAMA), 1, GAS, STEPS, lr=LR)
    cp1 = run_ranks(2, leg, root, cp=1, pp=2, dp=1, save="step1")
    _assert_continues(cp1, ref, 0, "CP 1")
    cp2 = run_ranks(4, save_at_cp2_and_convert, root)
    assert {r["plan"] for r in cp2} == {"by_name"} and {r["steps_at_load"] for r in cp2} == {1}
    _assert_same_state(cp2, cp1, "CP 1 -> CP 2")
    _assert_continues(cp2, ref, 1, "CP 1 -> CP 2")
    resumed = {"CP 4 x PP 1": run_ranks(4, resume_twice, root, 4, 1, 1),
               "CP 1 x PP 2 x DP 2": run_ranks(4, resume_twice, root, 1, 2, 2),
               "CP 1 x PP 2": [{"plain": r} for r in run_ranks(2, leg, root, cp=1, pp=2, dp=1, load=SAVED)]}
    plans = {"CP 4 x PP 1": "by_name", "CP 1 x PP 2 x DP 2": "deepspeed", "CP 1 x PP 2": "by_name"}
    for layout, per_rank in resumed.items():
        for how in per_rank[0]:
            results, what = [r[how] for r in per_rank], f"CP 2 x PP 2 -> {layout} ({how})"
            assert {r["plan"] for r in results} == {plans[layout] if how == "plain" else "universal"}, what
            assert {r["steps_at_load"] for r in results} == {2}, what
            _assert_same_state(results, cp2, what)
            for r in results:
                assert abs(r["eval"] - cp2[0]["eval_at_save"]) <= 1e-5, (what, r["eval"], cp2[0]["eval_at_save"])
            _assert_continues(results, ref, 2, what)
