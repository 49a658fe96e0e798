"""Checkpoint files and index caches load without running code (training/checkpoint/safe_load.py), in one process.

A crafted file pickles a call to open(path, "w") (tools/fault_injection.Payload): the payload never runs
(the file is not created) and the error names the file and the global it needed. What our checkpoints
hold (argparse.Namespace, numpy's RNG key, DeepSpeed's shard types) loads and compares equal. The
resumes under each launcher are in test_out_of_room.py.
"""
import argparse
import os
import random

import numpy as np
import pytest
import torch

from megatron_ds.convert import ToolError
from megatron_ds.data.dataset_utils import DataConfigError
from megatron_ds.data.gpt_dataset import load_index_cache
from megatron_ds.training.checkpoint import safe_load
from megatron_ds.training.checkpoint.engine import MegatronDSCheckpointEngine
from megatron_ds.training.checkpoint.save_load import CheckpointError
from tools.fault_injection import craft


def _client_state():
    from megatron_ds.training.initialize import get_rng_state
    return {"iteration": 4, "args": argparse.Namespace(num_layers=2, lr=3e-3, split="100,0,0", rampup=None,
                                                       sizes=[1, 2], ds={"a": 1}),
            "rng_state": get_rng_state()}


def test_what_our_checkpoints_hold_loads_equal(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    random.seed(3)
    np.random.seed(5)
    state = _client_state()
    shard = {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.optimizer_states, "loss_scaler": LossScaler(1.0),
                                      "param_slice_mappings": [{"w": fragment_address(numel=6, start=2)}]},
             "fp32": torch.arange(6.0)}
    torch.save(state, tmp_path / "mp_rank_00_model_states.pt")
    torch.save(shard, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    loaded = safe_load.load(str(tmp_path / "mp_rank_00_model_states.pt"))
    assert vars(loaded["args"]) == vars(state["args"])
    key, saved_key = loaded["rng_state"]["np_rng_state"], state["rng_state"]["np_rng_state"]
    assert key[0] == "MT19937" and np.array_equal(key[1], saved_key[1]) and key[2:] == saved_key[2:]
    assert loaded["rng_state"]["random_rng_state"] == state["rng_state"]["random_rng_state"]
    assert torch.equal(loaded["rng_state"]["torch_rng_state"], state["rng_state"]["torch_rng_state"])
    got = MegatronDSCheckpointEngine().load(str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "cpu")
    osd = got["optimizer_state_dict"]
    assert osd["zero_stage"] is ZeroStageEnum.optimizer_states and osd["loss_scaler"].cur_scale == 1.0
    assert osd["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=2)
    assert safe_load.check_step(str(tmp_path)) == 2
    with safe_load.weights_only_everywhere():  # DeepSpeed loads through our engine, and by torch.load itself
        MegatronDSCheckpointEngine().load(str(tmp_path / "mp_rank_00_model_states.pt"), "cpu")
        forced = torch.load(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert forced["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states


@pytest.mark.parametrize("torch_format", [True, False], ids=["torch.save", "bare-pickle"])
def test_a_file_that_would_run_code_is_refused_and_never_runs(tmp_path, torch_format):
    path = str(tmp_path / "global_step4" / "layer_01-model_states.pt")
    os.makedirs(os.path.dirname(path))
    torch.save({"weight": torch.ones(2)}, str(tmp_path / "global_step4" / "layer_00-model_states.pt"))
    payload = tmp_path / "payload-ran"
    craft(path, str(payload), torch_format=torch_format)
    for load in (safe_load.load, lambda p: MegatronDSCheckpointEngine().load(p, "cpu")):
        with pytest.raises(CheckpointError) as e:
            load(path)
        assert str(e.value).startswith(f"{path} is refused: loading it needs io.open, which could run code")
    with pytest.raises(CheckpointError, match=r"layer_01-model_states.pt is refused: loading it needs io.open"):
        safe_load.check_step(str(tmp_path / "global_step4"))
    assert safe_load.check_step(str(tmp_path / "global_step4"), skip=lambda rel: rel.startswith("layer_01")) == 1
    craft(str(tmp_path / "global_step4" / "layer_00-model_states.pt"), str(payload), torch_format=torch_format)
    with pytest.raises(CheckpointError, match=r"^checkpoint files are refused: \S+/layer_00-model_states.pt needs "
                                              r"io.open; \S+/layer_01-model_states.pt needs io.open: loading them "
                                              r"could run code"):
        safe_load.check_step(str(tmp_path / "global_step4"))
    with safe_load.weights_only_everywhere():  # what DeepSpeed's universal loader calls, forced weights-only
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(path, weights_only=False)
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    assert not payload.exists()


def test_hf_export_reads_the_checkpoint_safely(tmp_path):
    from megatron_ds.convert.ds_format import _load
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    craft(path, str(tmp_path / "payload-ran"))
    with pytest.raises(ToolError, match="mp_rank_00_model_states.pt is refused: loading it needs io.open"):
        _load(path)
    assert not (tmp_path / "payload-ran").exists()


def test_blending_cache_is_never_unpickled(tmp_path):
    from megatron_ds.data.blendable_dataset import cached_blending_indices
    first = cached_blending_indices([0.25, 0.75], 16, str(tmp_path))
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".npz"]
    again = cached_blending_indices([0.25, 0.75], 16, str(tmp_path))  # read back from the cache
    assert all(a.tolist() == b.tolist() for a, b in zip(first, again))
    craft(str(path), str(tmp_path / "payload-ran"), torch_format=False)
    with pytest.raises(DataConfigError, match=f"blending cache {path} is refused: it holds pickled data"):
        cached_blending_indices([0.25, 0.75], 16, str(tmp_path))
    assert not (tmp_path / "payload-ran").exists()


def test_index_cache_is_never_unpickled(tmp_path):
    good = tmp_path / "corpus_train_indexmap_doc_idx.npy"
    np.save(good, np.arange(10, dtype=np.int32))
    assert load_index_cache(str(good)).tolist() == list(range(10))
    bad = tmp_path / "corpus_train_indexmap_sample_idx.npy"
    craft(str(bad), str(tmp_path / "payload-ran"), torch_format=False)
    with pytest.raises(DataConfigError, match=f"index cache {bad} is refused: it holds pickled data"):
        load_index_cache(str(bad))
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataConfigError, match=f"index cache {bad} is refused"):
        load_index_cache(str(bad))
    np.save(bad, np.zeros(3, dtype=np.float32))
    with pytest.raises(DataConfigError, match=r"holds a 1-d float32 array, not integer indices"):
        load_index_cache(str(bad))
    assert not (tmp_path / "payload-ran").exists()
