"""A save that runs out of room (training/faults/disk_full.py), in one process: the failure is recorded with the
bytes the file needed, the half-written file and the incomplete step are removed, `latest` stays as it
was. The multi-rank runs (each stage of a save, every rank's exit) are in test_out_of_room.py."""
import argparse
import os

import pytest
import torch

from megatron_ds.training.faults import disk_full


def _begin(iteration, *inject):
    disk_full.begin(argparse.Namespace(inject_enospc=[list(i) for i in inject]), iteration)


def test_enospc_in_a_torch_file_is_recorded_with_its_size_and_the_step_removed(tmp_path):
    state = {"w": torch.arange(1000.0), "step": 3}
    step = tmp_path / "global_step3"
    step.mkdir()
    _begin(3, ("3", "optim_states"))
    disk_full.write_torch(state, str(step / "layer_00-model_states.pt"))  # not the injected file
    disk_full.write_torch(state, str(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert disk_full.failed() and sorted(os.listdir(step)) == ["layer_00-model_states.pt"]
    message = disk_full.agree(str(step), latest_tag="global_step2")
    assert not step.exists()  # nothing half-written stays for `latest` to name
    _begin(4)
    disk_full.write_torch(state, str(tmp_path / "again.pt"))  # a new save starts clean
    assert torch.equal(torch.load(tmp_path / "again.pt")["w"], state["w"])
    assert disk_full.agree(str(tmp_path), None) is None
    size = os.path.getsize(tmp_path / "again.pt")
    assert message.startswith(f"saving iteration 3: {step}/zero_pp_rank_0_mp_rank_00_optim_states.pt: No space left "
                              f"on device (ENOSPC): it needed {size} bytes, ")


def test_enospc_writing_latest_keeps_the_previous_one(tmp_path):
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "global_step4").mkdir()
    _begin(4, ("4", "latest"))
    assert disk_full.write_text(str(tmp_path / "latest"), "global_step4") is False
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert sorted(os.listdir(tmp_path)) == ["global_step4", "latest"]  # the temporary file is gone
    assert disk_full.agree(str(tmp_path / "global_step4"), "global_step2").startswith(
        f"saving iteration 4: {tmp_path}/latest: No space left on device (ENOSPC): it needed 12 bytes")
    _begin(5)
    assert disk_full.write_text(str(tmp_path / "latest"), "global_step5") is True
    assert (tmp_path / "latest").read_text() == "global_step5"


def test_other_write_errors_are_not_taken_for_a_full_disk(tmp_path):
    _begin(1)
    with pytest.raises(IsADirectoryError):
        disk_full.write_torch({"a": 1}, str(tmp_path))
    assert not disk_full.failed()
