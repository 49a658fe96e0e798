"""--async-save and retention without launching: the flags merged with ds_config "checkpoint", which steps
--keep-last-checkpoints deletes, the host copy a background save writes from."""
import json
import os

import pytest

from megatron_ds.training.checkpoint.retention import committed_steps, prune, to_delete
from megatron_ds.training.config.arguments import ArgumentsError, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "2"]

pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(tmp_path, *extra, ds=None):
    argv = BASE + list(extra)
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        argv += ["--deepspeed_config", str(tmp_path / "ds.json")]
    return parse_args(argv, env={"WORLD_SIZE": "1", "RANK": "0"})


def test_flags_and_ds_config_keys_merge(tmp_path):
    args = parse(tmp_path)
    assert (args.async_save, args.keep_last_checkpoints, args.keep_every) == (False, None, None)
    assert args.save_write_probe_mib == 0  # the sequential-write probe: on by default with --async-save only
    assert "checkpoint" not in args.ds_config
    args = parse(tmp_path, "--async-save", "--keep-last-checkpoints", "3", "--keep-every", "100")
    assert (args.async_save, args.keep_last_checkpoints, args.keep_every) == (True, 3, 100)
    assert args.ds_config["checkpoint"] == {"async_save": True, "keep_last": 3, "keep_every": 100}
    args = parse(tmp_path, "--keep-last-checkpoints", "2",
                 ds={"checkpoint": {"async_save": True, "keep_last": 2, "tag_validation": "Warn"}})
    assert (args.async_save, args.keep_last_checkpoints, args.save_write_probe_mib) == (True, 2, 256)
    assert args.ds_config["checkpoint"]["tag_validation"] == "Warn"  # DeepSpeed's own keys stay


@pytest.mark.parametrize("extra,ds,message", [
    (["--keep-last-checkpoints", "2"], {"checkpoint": {"keep_last": 3}},
     'keep-last-checkpoints 2 disagrees with ds_config "checkpoint": {"keep_last": 3}'),
    ([], {"checkpoint": {"async_save": "yes"}}, r'\{"async_save": \'yes\'\}.*must be true or false'),
    (["--keep-last-checkpoints", "0"], None, "--keep-last-checkpoints must be at least 1, got 0"),
    (["--keep-every", "5"], None, "--keep-every K keeps steps beside --keep-last-checkpoints N, which is missing"),
    (["--async-save"], {"checkpoint": {"writer": {"decoupled": True}}}, "DeepSpeed's decoupled writer names"),
    (["--save-write-probe-mib", "-1"], None, "--save-write-probe-mib must be >= 0"),
])
def test_bad_settings_are_one_line(tmp_path, extra, ds, message):
    with pytest.raises(ArgumentsError, match=message):
        parse(tmp_path, *extra, ds=ds)


def test_which_steps_are_deleted():
    steps = [2, 4, 6, 8, 10, 12]
    assert to_delete(steps, 12, keep_last=2) == [2, 4, 6, 8]
    assert to_delete(steps, 12, keep_last=2, keep_every=4) == [2, 6]
    assert to_delete(steps, 12, keep_last=2, keep_every=4, protected={6}) == [2]
    # a step above `latest` (a save never committed) is never counted nor deleted, `latest` never deleted
    assert to_delete(steps, 8, keep_last=1) == [2, 4, 6]
    assert to_delete([4], 4, keep_last=1) == []


def test_prune_deletes_committed_steps_only(tmp_path):
    for step in (2, 4, 6, 8):
        os.makedirs(tmp_path / f"global_step{step}")
        (tmp_path / f"global_step{step}" / "layer_00-model_states.pt").write_bytes(b"x")
        if step != 4:  # 4: a save a crash cut short, no manifest
            (tmp_path / f"global_step{step}" / "manifest.json").write_text("{}")
    assert committed_steps(str(tmp_path)) == [2, 6, 8]
    assert prune(str(tmp_path), 8, keep_last=1) == [2, 6]
    assert sorted(d for d in os.listdir(tmp_path) if "step" in d) == ["global_step4", "global_step8"]


def test_host_copy_is_a_copy():
    import collections

    import torch

    from megatron_ds.training.checkpoint.async_save import host_copy, tensor_bytes
    live = torch.arange(6, dtype=torch.float32)
    state = {"w": live[2:], "opt": collections.OrderedDict(step=3, moments=[live, (live * 2,)]), "name": "x"}
    copy = host_copy(state)
    live.add_(100.0)  # the optimizer moves on
    assert torch.equal(copy["w"], torch.arange(2, 6, dtype=torch.float32))
    assert torch.equal(copy["opt"]["moments"][1][0], torch.arange(6, dtype=torch.float32) * 2)
    assert type(copy["opt"]) is collections.OrderedDict and copy["opt"]["step"] == 3 and copy["name"] == "x"
    assert tensor_bytes(copy) == (4 + 6 + 6) * 4


def test_prune_finishes_a_deletion_a_kill_cut_short(tmp_path, capsys):
    for step in (2, 4, 6):
        os.makedirs(tmp_path / f"global_step{step}")
        (tmp_path / f"global_step{step}" / "manifest.json").write_text("{}")
    os.makedirs(tmp_path / ".deleting-global_step0")  # what a prune killed half-way leaves
    (tmp_path / ".deleting-global_step0" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert committed_steps(str(tmp_path)) == [2, 4, 6]  # a hidden folder is never a step
    assert prune(str(tmp_path), 6, keep_last=2) == [2]
    assert sorted(d for d in os.listdir(tmp_path) if "step" in d) == ["global_step4", "global_step6"]
    assert "finished deleting the checkpoints of iterations 0 (an earlier run stopped" in capsys.readouterr().out


def test_kill_point_specs(monkeypatch):
    from megatron_ds.training.checkpoint import kill_points
    assert kill_points.parse("4:1") == (4, "1", "writing")  # the two-field form: in the middle of the writes
    assert kill_points.parse("8:*:agreed") == (8, "*", "agreed")
    for bad in ("4", "4:x", "4:1:later", "a:1:copied"):
        with pytest.raises(ValueError, match="MEGATRON_DS_KILL_DURING_SAVE"):
            kill_points.parse(bad)
    monkeypatch.setenv(kill_points.ENV, "8:*:written")
    assert kill_points.due("written", 8, 0) and kill_points.due("written", 8, 3)
    assert not kill_points.due("written", 6, 0) and not kill_points.due("agreed", 8, 0)
    monkeypatch.setenv(kill_points.ENV, "4:1")
    assert kill_points.due("writing", 4, 1) and not kill_points.due("writing", 4, 0)


def test_ten_saves_keep_the_last_two_and_the_marked(tmp_path):
    """--keep-last-checkpoints 2 --keep-every 4 over 10 saves, one every 2 iterations, pruned after each commit as
    saves.py does: exactly the last two and the multiples of 4 remain, and each step is gone once two newer ones
    are committed."""
    for n, step in enumerate(range(2, 22, 2), 1):
        os.makedirs(tmp_path / f"global_step{step}")
        (tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x" * step)
        (tmp_path / f"global_step{step}" / "manifest.json").write_text("{}")
        prune(str(tmp_path), step, keep_last=2, keep_every=4)
        left = committed_steps(str(tmp_path))
        assert left == sorted({s for s in range(2, step + 1, 2) if s % 4 == 0} | {step - 2, step} - {0}), (n, left)
    assert n == 10 and committed_steps(str(tmp_path)) == [4, 8, 12, 16, 18, 20]
    assert sorted(d for d in os.listdir(tmp_path) if "step" in d) == \
        sorted(f"global_step{s}" for s in (4, 8, 12, 16, 18, 20))  # nothing else left behind


def test_host_buffers_are_reused_from_one_save_to_the_next(tmp_path):
    import torch

    from megatron_ds.training.checkpoint import engine, zip_writer
    from megatron_ds.training.checkpoint.async_save import HostBuffers
    live = torch.arange(12, dtype=torch.float32)
    state = lambda: {"module": {"w": live[2:], "t": live.view(-1, 4).t()},  # noqa: E731 - a view, a transpose
                     "optimizer": {"exp_avg": live * 2, "step": 3}, "n": torch.tensor(5)}
    buffers = HostBuffers()
    first = buffers.copier()(state(), str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt"))
    ptrs = [first["module"]["w"].data_ptr(), first["module"]["t"].data_ptr(), first["optimizer"]["exp_avg"].data_ptr()]
    assert buffers.allocated == 4 and first["module"]["t"].stride() == (1, 4)  # strides as a clone keeps them
    with pytest.raises(RuntimeError, match="still writing"):
        buffers.copier()  # the first save's writer has not released them
    buffers.release()
    live.add_(100.0)  # training moved on
    second = buffers.copier()(state(), str(tmp_path / "global_step4" / "mp_rank_00_model_states.pt"))
    assert buffers.allocated == 4  # no new buffer: the same storage
    assert [second["module"]["w"].data_ptr(), second["module"]["t"].data_ptr(),
            second["optimizer"]["exp_avg"].data_ptr()] == ptrs
    # its file equals a synchronous save's of the live state (DeepSpeed clones each tensor before it), record
    # for record
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    path = str(tmp_path / "ours.pt")
    engine.write_background(second, path, True)
    sync = str(tmp_path / "sync.pt")
    engine.write_file(clone_tensors_for_torch_save(state()), sync, True)
    ours, theirs = zip_writer.records_of(path), zip_writer.records_of(sync)
    assert {k: v for k, v in ours.items() if "serialization_id" not in k} == \
        {k: v for k, v in theirs.items() if "serialization_id" not in k}
    buffers.release()
    live = torch.arange(16, dtype=torch.float32)  # another shape: a new buffer for those that changed
    buffers.copier()(state(), str(tmp_path / "global_step6" / "mp_rank_00_model_states.pt"))
    assert buffers.allocated == 4 + 3
