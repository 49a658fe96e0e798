"""Fixtures the training tests share."""
import pytest


@pytest.fixture
def empty_corpus(tmp_path, monkeypatch):
    """The test runs in its own folder holding an empty corpus.bin/.idx pair: what --data-path corpus needs to
    parse (the flags check the files exist; nothing reads them)."""
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    return tmp_path
