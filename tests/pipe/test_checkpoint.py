"""A checkpoint saved under zbv (or bitpipe, which holds two replicas) at PP=2 loads under
1f1b at PP=4 with the same eval loss: layer files are named by global layer index."""
import os

from tests.gpt_harness import EVAL_STEP, ds_config, micro_batch, optimizer_for, tiny_config
from megatron_ds.testing.launcher import run_ranks

GAS, LAYERS = 4, 8
SCHEDULES = ("zbv", "bitpipe")  # bitpipe holds two replicas


def _engine(pp, pipeline):
    import deepspeed
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(LAYERS)
    cfg = ds_config(pp, dist.get_world_size() // pp, GAS, pipeline=pipeline)
    module = build_pipeline_module(config, cfg, pp)
    return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters())), config


def _eval(engine, config):
    return float(engine.eval_batch(iter([micro_batch(EVAL_STEP, j, config.vocab_size) for j in range(GAS)])))


def _step(engine, config, step):
    engine.train_batch(iter([micro_batch(step, j, config.vocab_size) for j in range(GAS)]))


def train_and_save(save_dir, schedule):
    """Two steps, save, then a third: the eval losses after the save and after the third step."""
    engine, config = _engine(2, {"schedule": schedule})
    for step in range(2):
        _step(engine, config, step)
    engine.save_checkpoint(save_dir, tag="step2")
    saved = _eval(engine, config)
    _step(engine, config, 2)
    return saved, _eval(engine, config)


def load_and_continue(save_dir, optimizer):
    """Load under 1f1b at PP=4 as checkpointing's plan says, eval, take the third step, eval."""
    from megatron_ds.training.checkpoint.save_load import LoadPlan, restore
    engine, config = _engine(4, {"schedule": "1f1b"})
    before = _eval(engine, config)
    restore(engine, save_dir, "step2", LoadPlan(optimizer, progress=True, reason="test"))
    loaded, steps = _eval(engine, config), engine.global_steps
    _step(engine, config, 2)
    return before, loaded, steps, _eval(engine, config)


def save_each(root):
    """{schedule: train_and_save} of every saving schedule, each into root/schedule."""
    return {schedule: train_and_save(os.path.join(root, schedule), schedule) for schedule in SCHEDULES}


def load_each(root):
    """{(schedule, optimizer): load_and_continue}: every checkpoint with Adam's state re-cut by name, and
    the control once, zbv's with a fresh Adam."""
    return {(schedule, optimizer): load_and_continue(os.path.join(root, schedule), optimizer)
            for schedule, optimizer in [(s, "by_name") for s in SCHEDULES] + [("zbv", None)]}


def test_pp2_checkpoints_load_under_1f1b_pp4(tmp_path):
    """Weights, DeepSpeed's step count and (re-cut by parameter name) Adam's state: the step after
    the load equals the step the saving run took; with a fresh optimizer it does not. One launch saves
    under every schedule, one loads them all."""
    saved = run_ranks(2, save_each, str(tmp_path))
    loads = run_ranks(4, load_each, str(tmp_path))
    for schedule in SCHEDULES:
        assert len({rank[schedule] for rank in saved}) == 1, schedule
        at_save, after_step = saved[0][schedule]
        files = sorted(p.name for p in (tmp_path / schedule / "step2").iterdir())
        assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt"
                                                                for i in range(LAYERS + 2)]
        for rank in loads:
            before, loaded, steps, stepped = rank[(schedule, "by_name")]
            assert abs(loaded - at_save) <= 1e-5, (schedule, loaded, at_save)
            assert abs(before - at_save) > 1e-3  # the load really changed the weights
            assert steps == 2
            assert abs(stepped - after_step) <= 1e-5 * abs(after_step), (schedule, stepped, after_step)
    at_save, after_step = saved[0]["zbv"]
    for rank in loads:  # the control: Adam restarting from zero moments takes another step
        _, loaded, _, stepped = rank[("zbv", None)]
        assert abs(loaded - at_save) <= 1e-5
        assert abs(stepped - after_step) > 1e-3, (stepped, after_step)
