"""torch.save's file format, written so that the background writer holds the GIL little.

torch.save's zip writer (PyTorchFileWriter) computes each record's CRC-32 and hands the bytes to a Python file
object chunk by chunk, holding the GIL throughout, and the manifest then read the file again for its CRC-32.
Here torch's own pickling (serialization._save: the same data.pkl, the same records in the same order, the
storages' bytes as they are) feeds Python's zipfile instead, whose CRC-32 (zlib) and writes release the GIL
on large buffers; each storage goes out as one write straight from the host buffer. The records are stored
uncompressed with their data aligned to torch's storage alignment (64 bytes, a padding extra field as torch
writes), so torch.load (mmap too), DeepSpeed and the universal converter read the file as one torch.save
wrote. The file's own CRC-32 and size are taken while writing (`CrcFile`, a large record's CRC-32 combined
from zipfile's), so the manifest entry needs no second read.
"""
import io
import pickle
import struct
import uuid
import zipfile
import zlib

ARCHIVE = "archive"  # the name torch.save gives the records of a file object's archive
VERSION = "3\n"      # torch.save's file format version for plain tensors and containers
PAD_ID = 0x4246      # "FB": the extra field torch pads a record's header with to align its data
BIG = 1 << 20        # records from this size on are read once (zipfile's CRC-32), not twice


class CrcFile:
    """A write-only file that keeps the CRC-32 and size of what went through it (zipfile needs `tell`). The
    data of a large record is not read a second time: its CRC-32, which zipfile computes for the record, is
    combined into the file's (`expect`, `fill`, crc32_combine's arithmetic)."""

    def __init__(self, raw):
        self.raw, self.size, self.parts, self.expected = raw, 0, [], 0  # parts: [CRC-32 or None, length]

    def expect(self, nbytes):
        """The next write of `nbytes` is a record's data, whose CRC-32 `fill` gives."""
        self.expected = nbytes

    def fill(self, crc):
        part = next(p for p in reversed(self.parts) if p[0] is None)
        part[0] = crc

    def write(self, data):
        n = len(data)
        if self.expected and n == self.expected:
            self.parts.append([None, n])
            self.expected = 0
        else:
            if not self.parts or self.parts[-1][0] is None:
                self.parts.append([0, 0])
            self.parts[-1][0] = zlib.crc32(data, self.parts[-1][0])
            self.parts[-1][1] += n
        self.raw.write(data)
        self.size += n
        return n

    @property
    def crc(self):
        crc = 0
        for part, length in self.parts:
            crc = crc32_combine(crc, part, length)
        return crc

    def tell(self):
        return self.size

    def flush(self):
        self.raw.flush()


POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed as zlib uses it


def _multmodp(a, b):
    """a * b modulo the CRC-32 polynomial (bit-reversed polynomials over GF(2))."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1, crc2, len2):
    """The CRC-32 of A + B from crc1 = CRC-32(A), crc2 = CRC-32(B), len2 = len(B): crc1 carried through len2
    zero bytes (x^(8 len2)), a few dozen multiplications, then B's."""
    p, n, k = 1 << 31, len2, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


class _Records:
    """The part of torch's PyTorchFileWriter that serialization._save calls, over a zipfile.ZipFile."""

    def __init__(self, f, alignment):
        self.zip = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.f, self.alignment = f, alignment

    def write_record(self, name, data, nbytes):
        info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        view = _bytes_of(data, nbytes)
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT  # what zipfile decides for the local header
        header = 30 + len(info.filename.encode("utf-8")) + (20 if zip64 else 0)
        pad = -(self.f.tell() + header + 4) % self.alignment
        info.extra = struct.pack("<HH", PAD_ID, pad) + b"Z" * pad
        big = nbytes >= BIG
        if big:
            self.f.expect(nbytes)
        self.zip.writestr(info, view)
        if big:  # zipfile's CRC-32 of the data is the file's CRC-32 of that part
            self.f.fill(info.CRC)

    def write_end_of_file(self):
        self.write_record("version", VERSION, len(VERSION))
        self.write_record(".data/serialization_id", uuid.uuid4().hex[:40].ljust(40, "0"), 40)
        self.zip.close()


def _bytes_of(data, nbytes):
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray)):
        return data
    import torch
    if nbytes == 0:
        return b""
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(data).numpy())  # the storage's bytes, not copied


def save(obj, f):
    """torch.save(obj, f)'s format into the file object `f`."""
    from torch import serialization
    if not isinstance(f, CrcFile):
        f = CrcFile(f)
    records = _Records(f, serialization._get_storage_alignment())
    try:
        serialization._save(obj, records, pickle, 2, False)
        records.write_end_of_file()
    except BaseException:
        records.zip.fp = None  # abandoned: no end records written into a failed file when it is collected
        raise


def records_of(path_or_bytes):
    """{record name: bytes} of a torch zip file, for comparing two writers' files."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with zipfile.ZipFile(src) as z:
        return {i.filename: z.read(i) for i in z.infolist()}
