"""Input sources for preprocessing, yielding records in document order.

A record is (location, payload): payload is either the raw bytes of one JSON
line (parsed later, in a worker) or a dict of column texts from a Hugging Face
dataset. location names the record in error messages.

JSON lines are streamed; a file can also be cut into byte ranges that each
worker reads on its own: a line belongs to the range in which it *starts*, so
contiguous ranges cover every line exactly once and in order.
"""
import os

from . import PreprocessError


class JsonlSource:
    kind = "jsonl"

    def __init__(self, path):
        if not os.path.isfile(path):
            raise PreprocessError(f"--input {path}: file not found")
        self.path = path
        self.total_bytes = os.path.getsize(path)
        self.total_docs = None

    def records(self):
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{self.path}: line {lineno}", line

    def split(self, n):
        """n contiguous byte ranges (start, end) covering the file."""
        size = self.total_bytes
        bounds = [size * i // n for i in range(n + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def range_records(self, part):
        start, end = part
        with open(self.path, "rb") as f:
            pos = start
            if start > 0:
                # The line holding byte start-1 belongs to an earlier range.
                f.seek(start - 1)
                pos = start - 1 + len(f.readline())
            while pos < end:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    yield _LineAt(self.path, pos), line
                pos += len(line)


class _LineAt:
    """Where a line of a byte range starts; its line number is counted only if an error needs it."""

    def __init__(self, path, offset):
        self.path, self.offset = path, offset

    def __str__(self):
        newlines, done = 0, 0
        with open(self.path, "rb") as f:
            while done < self.offset:
                block = f.read(min(1 << 24, self.offset - done))
                if not block:
                    break
                newlines += block.count(b"\n")
                done += len(block)
        return f"{self.path}: line {newlines + 1}"


# File types read through a `datasets` builder (by extension); anything else is JSON lines.
BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def builder_for(path):
    return BUILDERS.get(os.path.splitext(path)[1].lower(), "json")


class HFSource:
    """A Hugging Face dataset: a `save_to_disk` directory, or a JSON/Parquet/CSV/Arrow file via load_dataset."""
    kind = "datasets"

    def __init__(self, path, keys, split="train"):
        try:
            import datasets
        except ImportError:
            raise PreprocessError("reading through Hugging Face datasets needs the 'datasets' package") from None
        datasets.disable_progress_bars()
        try:
            if os.path.isdir(path):
                ds = datasets.load_from_disk(path)
            elif os.path.isfile(path):
                ds = datasets.load_dataset(builder_for(path), data_files=path, split=split)
            else:
                raise PreprocessError(f"--input {path}: no such file or directory")
        except PreprocessError:
            raise
        except Exception as e:  # datasets raises many types; the message is what matters
            raise PreprocessError(f"--input {path}: cannot load with Hugging Face datasets: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise PreprocessError(f"--input {path}: no split {split!r} (splits: {sorted(ds)}); use --split")
            ds = ds[split]
        missing = [k for k in keys if k not in ds.column_names]
        if missing:
            raise PreprocessError(f"--input {path}: no column {missing[0]!r} for --json-keys "
                                  f"(columns: {ds.column_names})")
        self.path = path
        self.dataset = ds.select_columns(list(keys))
        self.keys = list(keys)
        self.total_docs = len(ds)
        self.total_bytes = None

    def records(self):
        return self.range_records((0, self.total_docs))

    def split(self, n):
        bounds = [self.total_docs * i // n for i in range(n + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def range_records(self, part, batch_size=1000):
        start, end = part
        for batch_start in range(start, end, batch_size):
            batch = self.dataset[batch_start:min(end, batch_start + batch_size)]
            for j in range(len(batch[self.keys[0]])):
                yield f"{self.path}: row {batch_start + j}", {k: batch[k][j] for k in self.keys}


def open_source(path, keys, reader="auto", split="train"):
    """JSON lines are streamed by default; directories, Parquet/CSV/Arrow files and --input-reader datasets
    use HF datasets."""
    if reader == "jsonl" or (reader == "auto" and not os.path.isdir(path) and builder_for(path) == "json"):
        if os.path.isdir(path):
            raise PreprocessError(f"--input {path}: is a directory, not a JSON-lines file")
        return JsonlSource(path)
    return HFSource(path, keys, split)
