"""torch.save's file format, written so that the background writer holds the GIL little.

torch.save's zip writer (PyTorchFileWriter) computes each record's CRC-32 and hands the bytes to a Python file
object chunk by chunk, holding the GIL throughout: a writer thread then stalls the training thread of its own
process for most of the write. Here torch's own pickling (serialization._save: the same data.pkl, the same
records in the same order, the storages' bytes as they are) feeds Python's zipfile instead, whose CRC-32
(zlib) and writes release the GIL on large buffers; each storage goes out as one write straight from the host
buffer. The records are stored uncompressed with their data aligned to torch's storage alignment (64 bytes, a
padding extra field as torch writes), so torch.load (mmap too), DeepSpeed and the universal converter read the
file as one torch.save wrote. The file's own CRC-32 and size are taken while writing (`CrcFile`), so the
manifest entry needs no second read.
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


class CrcFile:
    """A write-only file that keeps the CRC-32 and size of what went through it (zipfile needs `tell`)."""

    def __init__(self, raw):
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data):
        self.crc = zlib.crc32(data, self.crc)
        n = self.raw.write(data)
        self.size += len(data) if n is None else n
        return n

    def tell(self):
        return self.size

    def flush(self):
        self.raw.flush()


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
        self.zip.writestr(info, view)

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
    records = _Records(f, serialization._get_storage_alignment())
    serialization._save(obj, records, pickle, 2, False)
    records.write_end_of_file()


def records_of(path_or_bytes):
    """{record name: bytes} of a torch zip file, for comparing two writers' files."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with zipfile.ZipFile(src) as z:
        return {i.filename: z.read(i) for i in z.infolist()}
