"""Checkpoints do not depend on context parallelism: a LLaMA-style GPT trained 2 steps at CP 2 x PP 2 (1f1b), saved,
resumes at CP 1 and takes the third step exactly as the uninterrupted single-process run does (fp32, 1e-5: every
weight after step 3, the eval loss at the save). The layout a checkpoint records counts the data axis (DP x CP,
what ZeRO-1's shards are cut over): at CP 1 x DP 2 (the same 2-rank data axis) the shards load as saved
("deepspeed"); at CP 1 x DP 1 they are re-cut parameter by parameter ("by_name"). The global batch is the same
samples in every layout: at DP 2 each replica takes half of the micro-batches."""

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, layer_key, micro_batch, optimizer_for, reference_run, tiny_config,
                               whole_tensors)
from tests.gpt_harness import ds_config as make_ds_config
from tests.pipe.parallel.test_context_parallel import LLAMA, LR, SEQ

GAS, LAYERS, PP = 4, 4, 2


def _engine(cp, dp):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(LAYERS, SEQ, **LLAMA, context_parallel_size=cp)
    cfg = make_ds_config(PP, dp, GAS // dp, pipeline={"schedule": "1f1b"}, lr=LR)
    module = build_pipeline_module(config, cfg, PP)
    return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), LR)), config


def _batches(engine, config, step, cp):
    dp = engine.dp_world_size // cp
    gas, replica = GAS // dp, engine.grid.get_data_parallel_rank() // cp
    return iter([micro_batch(step, replica * gas + j, config.vocab_size, SEQ) for j in range(gas)])


def train_and_save(save_dir):
    engine, config = _engine(cp=2, dp=1)
    for step in range(2):
        engine.train_batch(_batches(engine, config, step, 2))
    engine.save_checkpoint(save_dir, tag="step2")
    return float(engine.eval_batch(_batches(engine, config, EVAL_STEP, 2)))


def load_and_step(save_dir, dp):
    """Load at CP 1 x DP `dp` as the loader's plan says, evaluate, take the third step."""
    from megatron_ds.pipe.engine import pipeline_layout, saved_layout
    from megatron_ds.training.checkpoint.save_load import plan_load, read_saved_state, restore
    engine, config = _engine(cp=1, dp=dp)
    saved = read_saved_state(save_dir, "step2")
    plan = plan_load(saved_layout(saved), pipeline_layout(engine), finetune=False, no_load_optim=False,
                     zero_stage=1)
    restore(engine, save_dir, "step2", plan)
    loaded = float(engine.eval_batch(_batches(engine, config, EVAL_STEP, 1)))
    engine.train_batch(_batches(engine, config, 2, 1))
    weights = whole_tensors(engine, config, {layer_key(engine.module, n): p.detach()
                                             for n, p in engine.module.named_parameters()})
    return dict(plan=plan.optimizer, loaded=loaded, weights=weights, steps=engine.global_steps)


def test_a_context_parallel_checkpoint_resumes_at_cp1(tmp_path):
    save_dir = str(tmp_path / "cp2")
    saved = run_ranks(4, train_and_save, save_dir)
    runs = {dp: run_ranks(2 * dp, load_and_step, save_dir, dp) for dp in (2, 1)}
    ref = reference_run(tiny_config(LAYERS, SEQ, **LLAMA), 1, GAS, 3, lr=LR)
    for dp, results in runs.items():
        for r in results:
            assert r["plan"] == ("deepspeed" if dp == 2 else "by_name") and r["steps"] == 3
            assert abs(r["loaded"] - saved[0]) <= 1e-5, (dp, r["loaded"], saved[0])
            for key, w in ref["weights"].items():
                if key in r["weights"]:
                    diff = (r["weights"][key] - w).abs().max().item()
                    assert diff <= 1e-5, f"CP 2 -> CP 1 x DP {dp}: weight {key} after 3 steps: max abs diff {diff:.3g}"
        assert set().union(*(r["weights"] for r in results)) >= set(ref["weights"])
