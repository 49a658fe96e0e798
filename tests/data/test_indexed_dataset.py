import os
import pickle
import struct

import numpy as np
import pytest

from megatron_ds.data.indexed_dataset import (IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder,
                                              best_fitting_dtype, infer_dataset_impl, make_builder, make_dataset)

DOCS = [[5, 6, 7], [65000, 1], [42]]  # one item per document, as preprocess_data writes


def build(prefix, docs=DOCS, dtype=np.uint16):
    b = make_builder(prefix + ".bin", "mmap", dtype=dtype)
    for d in docs:
        b.add_item(np.array(d))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def test_idx_bytes_match_the_format_specification(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    raw = open(prefix + ".idx", "rb").read()
    # Header: 9-byte magic, <Q version, <B dtype code, <Q items, <Q doc_idx length.
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert raw[9:17] == (1).to_bytes(8, "little")
    assert raw[17] == 8  # uint16
    assert raw[18:26] == (3).to_bytes(8, "little")
    assert raw[26:34] == (4).to_bytes(8, "little")
    # int32 sizes, int64 byte pointers, int64 doc_idx, nothing after.
    assert raw[34:46] == struct.pack("<3i", 3, 2, 1)
    assert raw[46:70] == struct.pack("<3q", 0, 6, 10)
    assert raw[70:102] == struct.pack("<4q", 0, 1, 2, 3)
    assert len(raw) == 102
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 5, 6, 7, 65000, 1, 42)

    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.uint16
    assert [d.tolist() for d in ds[0:3]] == DOCS
    assert ds.sizes.tolist() == [3, 2, 1] and ds.pointers.tolist() == [0, 6, 10]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]
    assert ds.get(1, offset=1).tolist() == [1]
    assert ds[-1].tolist() == [42]


def test_reads_an_index_packed_by_hand_like_megatron_writes(tmp_path):
    # int32 tokens (code 4), two documents of two items each (sentence-level layout).
    items = [[1, 2], [3], [70000, 5, 6], [7]]
    sizes = [len(i) for i in items]
    pointers = np.cumsum([0] + [4 * s for s in sizes[:-1]]).tolist()
    doc_idx = [0, 2, 4]
    prefix = str(tmp_path / "meg")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(sizes), len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<7i", *sum(items, [])))
    ds = make_dataset(prefix, "infer", skip_warmup=False)
    assert infer_dataset_impl(prefix) == "mmap"
    assert ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(4)] == items
    assert ds.doc_idx.tolist() == doc_idx
    ds.validate()


def test_best_fitting_dtype_uses_megatrons_threshold(tmp_path):
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32
    for vocab, dtype in ((250880, np.int32), (50257, np.uint16)):
        builder = make_builder(str(tmp_path / "v.bin"), "mmap", vocab_size=vocab)
        assert builder.dtype == dtype
        builder.abort()


def test_builder_writes_nothing_under_the_final_name_until_finalize(tmp_path):
    prefix = str(tmp_path / "atomic")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_item([1, 2, 3])
    b.end_document()
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    b.abort()
    assert os.listdir(tmp_path) == []


def test_add_doc_and_merge_give_the_same_bytes_as_one_builder(tmp_path):
    whole = build(str(tmp_path / "whole"), DOCS + DOCS[::-1])
    a = build(str(tmp_path / "a"), DOCS)
    b = build(str(tmp_path / "b"), DOCS[::-1])
    merged = str(tmp_path / "merged")
    builder = make_builder(merged + ".bin", dtype=np.uint16)
    builder.merge_file_(a)
    builder.merge_file_(b)
    builder.finalize(merged + ".idx")
    for ext in (".bin", ".idx"):
        assert open(whole + ext, "rb").read() == open(merged + ext, "rb").read()

    multi = str(tmp_path / "multi")
    builder = make_builder(multi + ".bin", dtype=np.uint16)
    builder.add_doc(np.array([1, 2, 3, 4]), [3, 1])
    builder.finalize(multi + ".idx")
    ds = MMapIndexedDataset(multi)
    assert ds.sizes.tolist() == [3, 1] and ds.doc_idx.tolist() == [0, 2]


def test_pickles_by_path(tmp_path):
    ds = MMapIndexedDataset(build(str(tmp_path / "p")), skip_warmup=True)
    again = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 300
    assert again[1].tolist() == DOCS[1]


def test_empty_dataset_round_trips(tmp_path):
    prefix = build(str(tmp_path / "empty"), [])
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0] and ds[0:0] == []


@pytest.fixture
def good(tmp_path):
    return build(str(tmp_path / "good"))


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage, message", [
    (lambda p: _patch(p + ".idx", 0, b"NOTANIDX\x00"), "wrong magic"),
    (lambda p: _patch(p + ".idx", 0, b"TNTIDX\x00\x00"), "legacy"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "version 2"),
    (lambda p: _patch(p + ".idx", 17, b"\x09"), "unknown dtype code 9"),
    (lambda p: _truncate(p + ".idx", 80), "index truncated"),
    (lambda p: _truncate(p + ".idx", 20), "truncated index"),
    (lambda p: _truncate(p + ".idx", 0), "truncated index (0 bytes"),
    (lambda p: open(p + ".idx", "wb").write(b"{}"), "wrong magic b'{}'"),
    (lambda p: open(p + ".idx", "ab").write(b"\0" * 8), "trailing bytes"),
    (lambda p: _truncate(p + ".bin", 7), "data file truncated"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "longer than its index says"),
    (lambda p: _patch(p + ".idx", 17, b"\x04"), "int32 tokens"),  # dtype/size mismatch
    (lambda p: os.remove(p + ".bin"), "data file not found"),
    (lambda p: os.remove(p + ".idx"), "index file not found"),
    (lambda p: _patch(p + ".idx", 70, struct.pack("<q", 1)), "corrupt doc_idx"),
])
def test_damaged_files_give_one_clear_error_naming_the_file(good, damage, message):
    damage(good)
    with pytest.raises(IndexedDatasetError) as err:
        make_dataset(good, "mmap")
    text = str(err.value)
    assert message in text
    assert good in text


def test_merge_refuses_a_different_dtype(tmp_path, good):
    other = build(str(tmp_path / "wide"), DOCS, dtype=np.int32)
    builder = make_builder(str(tmp_path / "out.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="wide.idx: dtype int32 differs"):
        builder.merge_file_(other)
    builder.abort()


def test_validate_finds_a_bad_pointer(good):
    _patch(good + ".idx", 46 + 8, struct.pack("<q", 4))  # pointer of item 1: 6 -> 4
    ds = MMapIndexedDataset(good)
    with pytest.raises(IndexedDatasetError, match="pointer of item 1 is 4"):
        ds.validate()
