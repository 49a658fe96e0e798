"""write_atomic leaves the old file or the new one, never a half or a temporary; read_json names the file and why."""
import os

import pytest

from megatron_ds.files import UnreadableFile, read_json, write_atomic


def test_text_bytes_and_a_writer_land_whole(tmp_path):
    path = tmp_path / "a.txt"
    write_atomic(path, "one")
    assert path.read_text() == "one"
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    seen = []
    write_atomic(path, lambda tmp: (seen.append(tmp), open(tmp, "w").write("three")), suffix=".npy")
    assert path.read_text() == "three" and seen[0].endswith(f".tmp-{os.getpid()}.npy")
    assert os.listdir(tmp_path) == ["a.txt"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def half(tmp):
        open(tmp, "w").write("ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_read_json_names_the_file_and_why(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text('{"a": 1}')
    bad.write_text("{not json")
    assert read_json(good) == {"a": 1}
    with pytest.raises(UnreadableFile, match=r"bad.json cannot be read \(not valid JSON: Expecting"):
        read_json(bad)
    with pytest.raises(ValueError, match=r"^the manifest cannot be read \(\[Errno 2\] No such file"):
        read_json(tmp_path / "none.json", "the manifest")
