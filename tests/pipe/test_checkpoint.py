"""A checkpoint saved under zbv (or bitpipe, which holds two replicas) at PP=2 loads under
1f1b at PP=4 with the same eval loss: layer files are named by global layer index."""
import pytest

from tests.gpt_harness import EVAL_STEP, ds_config, micro_batch, optimizer_for, tiny_config
from tests.multiproc import run_ranks

GAS, LAYERS = 4, 8


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


def train_and_save(save_dir, schedule):
    engine, config = _engine(2, {"schedule": schedule})
    for step in range(2):
        engine.train_batch(iter([micro_batch(step, j, config.vocab_size) for j in range(GAS)]))
    engine.save_checkpoint(save_dir, tag="step2")
    return _eval(engine, config)


def load_and_eval(save_dir):
    engine, config = _engine(4, {"schedule": "1f1b"})
    before = _eval(engine, config)
    engine.load_checkpoint(save_dir)
    return before, _eval(engine, config)


@pytest.mark.parametrize("schedule", ["zbv", "bitpipe"])
def test_pp2_checkpoint_loads_under_1f1b_pp4(tmp_path, schedule):
    saved = run_ranks(2, train_and_save, str(tmp_path), schedule)
    assert len(set(saved)) == 1
    files = sorted(p.name for p in (tmp_path / "step2").iterdir())
    assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt" for i in range(LAYERS + 2)]
    loaded = run_ranks(4, load_and_eval, str(tmp_path))
    for before, after in loaded:
        assert abs(after - saved[0]) <= 1e-5, (after, saved[0])
        assert abs(before - saved[0]) > 1e-3  # the load really changed the weights
