"""Megatron's mmap indexed dataset: a `.bin` of raw tokens plus an `.idx` index.

The bytes are exactly Megatron-LM's / Megatron-DeepSpeed's ``MMIDIDX`` format, so
corpora preprocessed by either tool load here and ours load there:

    .idx (little-endian)
    offset 0   9 bytes  magic b"MMIDIDX\\x00\\x00"
    offset 9   uint64   version = 1
    offset 17  uint8    dtype code (see DTYPES)
    offset 18  uint64   N = number of items (len(sizes))
    offset 26  uint64   D = len(doc_idx)
    offset 34  int32[N] sizes     tokens per item
               int64[N] pointers  byte offset of each item in .bin
               int64[D] doc_idx   item index where each document starts; [0] = 0
    .bin       every item's tokens in the dtype, back to back, no header.

Every defect a reader can see cheaply (missing file, wrong magic or version,
unknown dtype, truncated or padded .idx, a .bin whose length disagrees with the
index) raises IndexedDatasetError naming the file and the problem.
"""
import array
import os
import shutil
import struct

import numpy as np

from megatron_ds.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D
HEADER_SIZE = HEADER.size  # 34

# Megatron's table. Codes 6 and 7 are both float64 in BigScience's copy (7 is
# float32 in Microsoft's); token files only ever use 8 (uint16) or 4 (int32).
DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
_WRITE_CODES = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 8: 8}
_CODE_OF = {DTYPES[c]: c for c in _WRITE_CODES}
_LEGACY_MAGIC = b"TNTIDX\x00\x00"


class IndexedDatasetError(UserError, ValueError):
    """A .bin/.idx pair that cannot be read or written as asked."""


def code(dtype):
    """The .idx dtype code of a numpy dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise IndexedDatasetError(f"dtype {dt} has no code in the MMIDIDX format "
                                  f"(supported: {sorted(str(d) for d in _CODE_OF)})")
    return _CODE_OF[dt]


def best_fitting_dtype(vocab_size=None):
    # Megatron's threshold is 65500, not 65536; keep it so our files equal theirs.
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix_path):
    return prefix_path + ".idx"


def data_file_path(prefix_path):
    return prefix_path + ".bin"


def dataset_exists(path, impl="mmap"):
    return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def infer_dataset_impl(path):
    """'mmap' for an MMIDIDX index; an error for anything else."""
    idx = index_file_path(path)
    if not os.path.isfile(idx):
        raise IndexedDatasetError(f"{idx}: index file not found")
    with open(idx, "rb") as f:
        magic = f.read(len(MAGIC))
    if magic == MAGIC:
        return "mmap"
    if magic[:8] == _LEGACY_MAGIC:
        raise IndexedDatasetError(f"{idx}: legacy 'lazy'/'cached' (TNTIDX) index; only "
                                  f"'mmap' is supported, re-run preprocessing with --dataset-impl mmap")
    raise IndexedDatasetError(f"{idx}: not a Megatron index (magic {magic!r}, expected {MAGIC!r})")


class MMapIndex:
    """The parsed, validated `.idx` of one dataset (arrays are read-only views)."""

    def __init__(self, path, skip_warmup=True):
        self.path = path
        try:
            file_size = os.path.getsize(path)
        except OSError:
            raise IndexedDatasetError(f"{path}: index file not found") from None
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if head[:8] == _LEGACY_MAGIC:
            raise IndexedDatasetError(f"{path}: legacy 'lazy'/'cached' (TNTIDX) index; only 'mmap' is supported")
        if head and not MAGIC.startswith(head[:len(MAGIC)]):  # a cut-off magic is a truncation
            raise IndexedDatasetError(f"{path}: wrong magic {head[:len(MAGIC)]!r}, expected {MAGIC!r}")
        if file_size < HEADER_SIZE:
            raise IndexedDatasetError(f"{path}: truncated index ({file_size} bytes, the header "
                                      f"alone is {HEADER_SIZE})")
        magic, version, dcode, n, d = HEADER.unpack(head)
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version} (expected {VERSION})")
        if dcode not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {dcode} (valid: {sorted(DTYPES)})")
        expected = HEADER_SIZE + 12 * n + 8 * d
        if file_size != expected:
            what = "truncated" if file_size < expected else "has trailing bytes"
            raise IndexedDatasetError(
                f"{path}: index {what}: header says {n} items and {d} doc_idx entries, which "
                f"need {expected} bytes, the file has {file_size}")
        self.dtype_code = dcode
        self.dtype = DTYPES[dcode]
        if file_size > HEADER_SIZE:
            buf = np.memmap(path, mode="r", dtype=np.uint8)
            if not skip_warmup:
                _warmup(buf)
            self.sizes = np.frombuffer(buf, np.int32, n, HEADER_SIZE)
            self.pointers = np.frombuffer(buf, np.int64, n, HEADER_SIZE + 4 * n)
            self.doc_idx = np.frombuffer(buf, np.int64, d, HEADER_SIZE + 12 * n)
        else:
            self.sizes = np.zeros(0, np.int32)
            self.pointers = np.zeros(0, np.int64)
            self.doc_idx = np.zeros(0, np.int64)
        if d == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] > n:
            raise IndexedDatasetError(f"{path}: corrupt doc_idx (must start at 0 and end at most "
                                      f"at {n}; got {self.doc_idx[:1].tolist()}..{self.doc_idx[-1:].tolist()})")
        # O(1) checks only: opening a billion-item index must stay instant (see validate()).
        if n and (self.pointers[0] != 0 or self.sizes[-1] < 0 or self.pointers[-1] < 0):
            raise IndexedDatasetError(f"{path}: corrupt index (first pointer {self.pointers[0]}, "
                                      f"last pointer {self.pointers[-1]}, last size {self.sizes[-1]})")

    def __len__(self):
        return len(self.sizes)

    def data_bytes(self, itemsize=None):
        """Length the .bin must have according to this index."""
        itemsize = itemsize or self.dtype.itemsize
        if len(self.sizes) == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize

    @staticmethod
    def write(path, dtype, sizes, doc_idx):
        """Write an index for items of `sizes` tokens; pointers follow from sizes."""
        dt = np.dtype(dtype)
        sizes = np.asarray(sizes, dtype=np.int64)
        if len(sizes) and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
            raise IndexedDatasetError(f"{path}: item sizes must fit int32 (got {sizes.min()}..{sizes.max()})")
        pointers = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1] * dt.itemsize, out=pointers[1:])
        doc_idx = np.asarray(doc_idx, dtype=np.int64)
        with open(path, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, code(dt), len(sizes), len(doc_idx)))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))


def _warmup(buf, chunk=100 * 1024 * 1024):
    # Touch every page once so the first training steps do not stall on page faults.
    for start in range(0, len(buf), chunk):
        int(np.asarray(buf[start:start + chunk]).sum(dtype=np.uint64))


class MMapIndexedDataset:
    """Read-only view of `prefix.bin` / `prefix.idx`; item i is a numpy array of tokens."""

    Index = MMapIndex

    def __init__(self, path, skip_warmup=False):
        self._do_init(path, skip_warmup)

    def _do_init(self, path, skip_warmup):
        self._path = path
        self._skip_warmup = skip_warmup
        self._index = MMapIndex(index_file_path(path), skip_warmup)
        bin_path = data_file_path(path)
        try:
            bin_size = os.path.getsize(bin_path)
        except OSError:
            raise IndexedDatasetError(f"{bin_path}: data file not found (its index "
                                      f"{index_file_path(path)} exists)") from None
        self._index.dtype = _resolve_dtype(self._index, bin_size, bin_path)
        expected = self._index.data_bytes()
        if bin_size != expected:
            what = "truncated" if bin_size < expected else "longer than its index says"
            raise IndexedDatasetError(
                f"{bin_path}: data file {what}: the index describes {expected} bytes of "
                f"{self._index.dtype} tokens, the file has {bin_size}")
        if bin_size:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)
            if not skip_warmup:
                _warmup(self._bin)
        else:
            self._bin = np.zeros(0, np.uint8)

    def __getstate__(self):
        # Only the path travels to DataLoader workers; they re-open their own maps.
        return self._path

    def __setstate__(self, state):
        self._do_init(state, skip_warmup=True)

    def __len__(self):
        return len(self._index)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an indexed dataset must be contiguous")
            sizes = self._index.sizes[start:stop]
            if len(sizes) == 0:
                return []
            flat = self._tokens(self._index.pointers[start], int(sizes.sum()))
            return np.split(flat, np.cumsum(sizes)[:-1])
        raise TypeError(f"indexed dataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset+length) of item idx (to its end when length is None)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"item {idx} out of range for {self._path} ({n} items)")
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for item "
                             f"{idx} of {self._path} ({size} tokens)")
        ptr = int(self._index.pointers[idx]) + offset * self._index.dtype.itemsize
        return self._tokens(ptr, length)

    def _tokens(self, byte_offset, count):
        itemsize = self._index.dtype.itemsize
        raw = self._bin[int(byte_offset):int(byte_offset) + count * itemsize]
        return np.frombuffer(raw, dtype=self._index.dtype, count=count)

    @property
    def sizes(self):
        return self._index.sizes

    @property
    def pointers(self):
        return self._index.pointers

    @property
    def doc_idx(self):
        return self._index.doc_idx

    @property
    def dtype(self):
        return self._index.dtype

    def get_doc_idx(self):
        return self._index.doc_idx

    def set_doc_idx(self, doc_idx):
        self._index.doc_idx = doc_idx

    @property
    def supports_prefetch(self):
        return False

    @staticmethod
    def exists(path):
        return dataset_exists(path)

    def validate(self):
        """Full O(N) consistency check (pointers vs sizes, doc_idx order); cheap ones ran at open."""
        idx = self._index
        expect = np.zeros(len(idx.sizes), np.int64)
        np.cumsum(idx.sizes[:-1].astype(np.int64) * idx.dtype.itemsize, out=expect[1:])
        if len(idx.sizes) and idx.sizes.min() < 0:
            raise IndexedDatasetError(f"{idx.path}: negative item size {idx.sizes.min()}")
        bad = np.flatnonzero(expect != idx.pointers)
        if len(bad):
            raise IndexedDatasetError(f"{idx.path}: pointer of item {bad[0]} is {idx.pointers[bad[0]]}, "
                                      f"the sizes before it put it at {expect[bad[0]]}")
        if len(idx.doc_idx) > 1 and np.any(np.diff(idx.doc_idx) < 0):
            raise IndexedDatasetError(f"{idx.path}: doc_idx is not sorted")


def _resolve_dtype(index, bin_size, bin_path):
    # Code 7 means float64 to BigScience and float32 to Microsoft; the .bin length decides.
    if index.dtype_code == 7 and index.data_bytes(8) != bin_size and index.data_bytes(4) == bin_size:
        return np.dtype(np.float32)
    return index.dtype


class MMapIndexedDatasetBuilder:
    """Appends items and documents to a new dataset; see finalize() for atomicity.

    Tokens go to `out_file + '.tmp'`; finalize(index_file) writes the index to a
    temporary name too and renames both into place, so a crash never leaves a
    half-written dataset under the final name.
    """

    def __init__(self, out_file, dtype=np.int64):
        self._out_file = out_file
        self._tmp_bin = out_file + ".tmp"
        self._dtype = np.dtype(dtype)
        code(self._dtype)
        self._data_file = open(self._tmp_bin, "wb")
        self._sizes = array.array("q")
        self._doc_idx = array.array("q", [0])

    @property
    def dtype(self):
        return self._dtype

    def add_item(self, tensor):
        # Accepts torch tensors, numpy arrays and lists without importing torch.
        arr = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=self._dtype)
        self._data_file.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)

    def add_doc(self, tensor, sizes):
        """Append a document whose items are consecutive runs of `sizes` tokens."""
        arr = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=self._dtype)
        if int(np.sum(sizes)) != arr.size:
            raise IndexedDatasetError(f"add_doc: sizes sum to {int(np.sum(sizes))}, the document "
                                      f"has {arr.size} tokens")
        self._data_file.write(arr.tobytes(order="C"))
        self._sizes.extend(int(s) for s in sizes)
        self._doc_idx.append(len(self._sizes))

    def end_document(self):
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file):
        """Append the dataset at prefix `another_file` (items, documents and tokens)."""
        other = MMapIndexedDataset(another_file, skip_warmup=True)
        if other.dtype != self._dtype:
            raise IndexedDatasetError(f"{index_file_path(another_file)}: dtype {other.dtype} differs "
                                      f"from the dataset being built ({self._dtype})")
        offset = len(self._sizes)
        self._sizes.frombytes(other.sizes.astype(np.int64).tobytes())
        self._doc_idx.frombytes((other.doc_idx[1:] + offset).astype(np.int64).tobytes())
        with open(data_file_path(another_file), "rb") as f:
            shutil.copyfileobj(f, self._data_file, 16 * 1024 * 1024)

    def finalize(self, index_file):
        self._data_file.close()
        tmp_idx = index_file + ".tmp"
        try:
            MMapIndex.write(tmp_idx, self._dtype, np.frombuffer(self._sizes, np.int64),
                            np.frombuffer(self._doc_idx, np.int64))
            os.replace(self._tmp_bin, self._out_file)
            os.replace(tmp_idx, index_file)
        except BaseException:
            _remove(tmp_idx)
            self.abort()
            raise

    def abort(self):
        """Drop everything written so far (for error paths)."""
        if not self._data_file.closed:
            self._data_file.close()
        _remove(self._tmp_bin)


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def make_builder(out_file, impl="mmap", dtype=None, vocab_size=None):
    """Builder for `out_file` (a .bin path). dtype wins; else best_fitting_dtype(vocab_size)."""
    if impl != "mmap":
        raise IndexedDatasetError(f"dataset impl {impl!r} is not supported for writing; use 'mmap'")
    if dtype is None:
        dtype = best_fitting_dtype(vocab_size)
    return MMapIndexedDatasetBuilder(out_file, dtype=dtype)


def make_dataset(path, impl="mmap", skip_warmup=False):
    """Open the dataset at prefix `path`; impl 'infer' reads the magic."""
    if not os.path.isfile(index_file_path(path)):
        raise IndexedDatasetError(f"{index_file_path(path)}: index file not found "
                                  f"(the data prefix is given without .bin/.idx)")
    if impl == "infer":
        impl = infer_dataset_impl(path)
    if impl != "mmap":
        raise IndexedDatasetError(f"dataset impl {impl!r} is not supported; use 'mmap' or 'infer'")
    return MMapIndexedDataset(path, skip_warmup)
