"""zip_writer: the background writer's torch.save format, record for record, without a launch."""
import io
import os
import struct
import zipfile
import zlib

import pytest
import torch

from megatron_ds.training.checkpoint import engine, zip_writer
from megatron_ds.training.faults import disk_full


def test_crc32_combine_is_zlibs():
    data = os.urandom(3000) + bytes(5000)
    for cut in (0, 1, 17, 2999, 8000):
        a, b = data[:cut], data[cut:]
        assert zip_writer.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def _state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=g)
    return {"module": {"w": base, "view": base[1:3], "bf16": torch.ones(4, dtype=torch.bfloat16) / 3,
                       "i64": torch.arange(6), "empty": torch.empty(0)},
            "optimizer_state_dict": {"state": {0: {"exp_avg": torch.randn(300, generator=g), "step": 3}},
                                     "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "iteration": 8, "args": None}


def _offsets(data):
    out = {}
    z = zipfile.ZipFile(io.BytesIO(data))
    for i in z.infolist():
        fnl, exl = struct.unpack("<HH", data[i.header_offset + 26:i.header_offset + 30])
        out[i.filename] = i.header_offset + 30 + fnl + exl
    return out


@pytest.mark.parametrize("big", [1 << 20, 1])  # 1: every record's data read once, its CRC-32 combined
def test_the_records_are_torch_saves(tmp_path, monkeypatch, big):
    monkeypatch.setattr(zip_writer, "BIG", big)
    state = _state()
    theirs = io.BytesIO()
    torch.save(state, theirs)
    ours = io.BytesIO()
    f = zip_writer.CrcFile(ours)
    zip_writer.save(state, f)
    a, b = zip_writer.records_of(theirs.getvalue()), zip_writer.records_of(ours.getvalue())
    assert list(a) == list(b) and len(a) == 11  # data.pkl and 3 small records, 5 storages, version, the id
    assert {k: v for k, v in a.items() if "serialization_id" not in k} == \
        {k: v for k, v in b.items() if "serialization_id" not in k}  # the same pickle, the same bytes
    assert zipfile.ZipFile(io.BytesIO(ours.getvalue())).testzip() is None  # every record's CRC-32 right
    assert (f.crc, f.size) == (zlib.crc32(ours.getvalue()), len(ours.getvalue()))
    assert all(off % 64 == 0 for off in _offsets(ours.getvalue()).values())  # torch's storage alignment
    path = tmp_path / "ours.pt"
    path.write_bytes(ours.getvalue())
    for mmap in (False, True):
        got = torch.load(path, mmap=mmap, weights_only=True)
        for k, v in state["module"].items():
            assert got["module"][k].dtype == v.dtype and torch.equal(got["module"][k], v), k
        assert got["module"]["view"].untyped_storage().data_ptr() == got["module"]["w"].untyped_storage().data_ptr()
        assert torch.equal(got["optimizer_state_dict"]["state"][0]["exp_avg"],
                           state["optimizer_state_dict"]["state"][0]["exp_avg"])
        assert got["iteration"] == 8 and got["optimizer_state_dict"]["param_groups"] == [{"lr": 1e-3, "params": [0]}]


def test_the_background_write_takes_the_manifest_entry_while_writing(tmp_path):
    from megatron_ds.training.checkpoint.manifest import entry
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    _, size, crc = engine.write_background(_state(), path, True)
    assert {"size": size, "crc32": f"{crc:08x}"} == entry(path)
    _, size, crc = engine.write_background(_state(), str(tmp_path / "legacy.pt"), False)  # torch's own writer
    assert crc is None and size == os.path.getsize(tmp_path / "legacy.pt")


def test_out_of_room_in_the_background_writer_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setitem(disk_full._state, "inject", [(6, "optim_states")])
    monkeypatch.setitem(disk_full._state, "iteration", 6)
    monkeypatch.setitem(disk_full._state, "failures", [])
    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _, size, crc = engine.write_background(_state(), path, True)
    assert (size, crc) == (0, None) and not os.path.exists(path)
    [failure] = disk_full._state["failures"]
    assert failure.needed == len(_saved_bytes(_state()))  # the size the whole file would have had


def _saved_bytes(state):
    out = io.BytesIO()
    zip_writer.save(state, zip_writer.CrcFile(out))
    return out.getvalue()


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65])
def test_any_name_length_and_size_stays_aligned(n):
    out = io.BytesIO()
    zip_writer.save({"x" * n: torch.ones(n, dtype=torch.uint8), "y": torch.zeros(n + 1)}, zip_writer.CrcFile(out))
    assert all(off % 64 == 0 for off in _offsets(out.getvalue()).values())
    got = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
    assert torch.equal(got["x" * n], torch.ones(n, dtype=torch.uint8)) and torch.equal(got["y"], torch.zeros(n + 1))


def test_zip64_records_stay_aligned_and_load(monkeypatch):
    """Records past zip's 4 GiB limit carry zip64 fields (20 more header bytes): shown with the limit lowered."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)
    state = {"big": torch.arange(600, dtype=torch.float32), "small": torch.ones(3)}
    out = io.BytesIO()
    f = zip_writer.CrcFile(out)
    zip_writer.save(state, f)
    data = out.getvalue()
    assert any(i.file_size > 1000 and i.extra for i in zipfile.ZipFile(io.BytesIO(data)).infolist())
    assert all(off % 64 == 0 for off in _offsets(data).values())
    assert f.crc == zlib.crc32(data)
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(got["big"], state["big"]) and torch.equal(got["small"], state["small"])
