"""tools/preprocess_data_many_cores.py: every worker tokenizes its own slice into a shard.

The input is cut into --workers contiguous slices (byte ranges of a JSON-lines
file, row ranges of a Hugging Face dataset). Worker k writes shard k with no
traffic back to the parent except progress counters; the shards are then
merged in slice order, so the result is byte-identical to tools/preprocess_data.py.
"""
import multiprocessing
import os
import sys
import time

from ..indexed_dataset import make_builder
from .args import build_parser, output_prefix_for
from .encoder import set_worker_encoder
from .pipeline import check_documents, main as _main, prepare, write_encoded
from .progress import Progress

_COUNTERS = None  # shared int64 [docs_0, bytes_0, docs_1, bytes_1, ...], inherited by fork
_SOURCE = None
_ENCODER = None


def _shard_prefixes(args, part, parts):
    return {key: f"{output_prefix_for(args, key)}.shard{part:05d}-of-{parts:05d}" for key in args.json_keys}


def _work(part, rng, prefixes, report_every):
    counts = [0, 0]  # documents, bytes

    def report(nbytes):
        counts[0] += 1
        counts[1] += nbytes
        if counts[0] % report_every == 0:
            _COUNTERS[2 * part], _COUNTERS[2 * part + 1] = counts

    kept_empty = write_encoded(map(_ENCODER.encode, _SOURCE.range_records(rng)), prefixes, _ENCODER.dtype, report)
    _COUNTERS[2 * part], _COUNTERS[2 * part + 1] = counts
    return kept_empty


def _remove_dataset(prefix):
    for ext in (".bin", ".idx", ".bin.tmp", ".idx.tmp"):
        try:
            os.remove(prefix + ext)
        except FileNotFoundError:
            pass


def run(args):
    global _COUNTERS, _SOURCE, _ENCODER
    source, encoder, _ = prepare(args)
    parts = args.workers
    ranges = source.split(parts)
    shard_prefixes = [_shard_prefixes(args, k, parts) for k in range(parts)]
    print(f"Tokenizing {args.input} in {parts} slices with {parts} worker(s)", file=sys.stderr, flush=True)
    ctx = multiprocessing.get_context("fork")
    _COUNTERS = ctx.Array("q", 2 * parts, lock=False)
    _SOURCE, _ENCODER = source, encoder
    set_worker_encoder(encoder)
    progress = Progress(source.total_bytes, source.total_docs, args.log_interval)
    pool = ctx.Pool(parts)
    try:
        jobs = [pool.apply_async(_work, (k, ranges[k], shard_prefixes[k], max(1, args.chunk_size)))
                for k in range(parts)]
        pool.close()
        while not all(job.ready() for job in jobs):
            time.sleep(0.2)
            progress.set_totals(sum(_COUNTERS[0::2]), sum(_COUNTERS[1::2]))
            for job in jobs:  # fail fast: the first worker error stops everything
                if job.ready() and not job.successful():
                    job.get()
        shard_counts = [job.get() for job in jobs]
        check_documents(args, {key: [sum(c[key][i] for c in shard_counts) for i in (0, 1)]
                               for key in args.json_keys})
        progress.set_totals(sum(_COUNTERS[0::2]), sum(_COUNTERS[1::2]))
        stats = progress.close()
        for key in args.json_keys:
            final = output_prefix_for(args, key)
            builder = make_builder(final + ".bin", "mmap", dtype=encoder.dtype)
            try:
                for shards in shard_prefixes:
                    builder.merge_file_(shards[key])
                builder.finalize(final + ".idx")
            except BaseException:
                builder.abort()
                raise
        print(f"Merged {parts} shards into {', '.join(output_prefix_for(args, k) for k in args.json_keys)}",
              file=sys.stderr, flush=True)
        return stats
    except BaseException:
        progress.close(summary=False)
        raise
    finally:
        pool.terminate()
        pool.join()
        for shards in shard_prefixes:
            for prefix in shards.values():
                _remove_dataset(prefix)


def main(argv=None):
    return _main(argv, lambda: build_parser(
        "Tokenize a corpus with many workers, one shard each, merged in input order.", many_cores=True), run)
