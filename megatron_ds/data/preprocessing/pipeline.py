"""tools/preprocess_data.py: one reader, a pool of tokenizing workers, one writer per key.

Records are handed to the workers in order and their results come back in
order (Pool.imap), so the output does not depend on --workers.
"""
import multiprocessing
import sys
import threading

from megatron_ds.errors import UserError

from ..indexed_dataset import best_fitting_dtype, make_builder
from ..tokenizer import build_tokenizer
from . import PreprocessError
from .args import build_parser, check_args, output_prefix_for
from .encoder import Encoder, encode_in_worker, set_worker_encoder
from .progress import Progress
from .reader import open_source


def prepare(args):
    """Validated args -> (source, encoder, tokenizer); no output touched yet."""
    check_args(args)
    source = open_source(args.input, args.json_keys, args.input_reader, args.split)
    tokenizer = build_tokenizer(args)
    # The unpadded vocabulary decides the dtype, as Megatron's preprocess_data does.
    encoder = Encoder(tokenizer, args.json_keys, args.append_eod, best_fitting_dtype(tokenizer.vocab_size))
    return source, encoder, tokenizer


def fork_pool(workers, encoder):
    set_worker_encoder(encoder)
    # fork: workers inherit the tokenizer instead of rebuilding or unpickling it.
    return multiprocessing.get_context("fork").Pool(workers)


STOP_GRACE = 10.0  # seconds stop_pool gives Pool.terminate before it kills the workers


def stop_pool(pool, grace=STOP_GRACE):
    """Stop `pool`'s workers within about 2 x `grace` seconds. Pool.terminate first takes its task queue's read lock,
    which an idle worker holds while it waits for a task; CPython's own sentinels normally free it, but once, on a
    loaded CI machine, a failing run waited there until its test's timeout. So terminate runs on a daemon thread
    (it cannot hold up the exit), and after `grace` the workers are killed."""
    def terminate():
        pool.terminate()
        pool.join()
    stopper = threading.Thread(target=terminate, name="stop-tokenizing-workers", daemon=True)
    stopper.start()
    stopper.join(grace)
    if stopper.is_alive():
        for worker in list(getattr(pool, "_pool", ())):
            worker.kill()
        stopper.join(grace)


def write_encoded(encoded, prefixes, dtype, on_document, check=None):
    """Write (nbytes, {key: ids}) results as one dataset per key at `prefixes[key]`, atomically:
    any error aborts every builder. `on_document(nbytes)` runs after each document; `check(counts)`,
    with counts = {key: [kept, empty]}, runs before anything is finalized. Returns counts."""
    builders = {key: make_builder(prefix + ".bin", "mmap", dtype=dtype) for key, prefix in prefixes.items()}
    counts = {key: [0, 0] for key in prefixes}
    try:
        for nbytes, docs in encoded:
            for key, ids in docs.items():
                counts[key][ids is None] += 1
                if ids is not None:
                    builders[key].add_item(ids)
                    builders[key].end_document()
            on_document(nbytes)
        if check is not None:
            check(counts)
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return counts


def check_documents(args, counts):
    """A key that yields no document, or drops more than --max-empty-fraction of them as empty, is an error
    (a wrong --json-keys or a column of nulls, not a corpus)."""
    for key, (kept, empty) in counts.items():
        total = kept + empty
        if kept == 0:
            why = f"{empty} record(s), all empty" if empty else "the input holds no records"
            raise PreprocessError(f"--input {args.input}: --json-keys {key!r} yields 0 documents ({why}); "
                                  "check the key and the input")
        if empty > args.max_empty_fraction * total:
            raise PreprocessError(f"--input {args.input}: --json-keys {key!r} is empty in {empty} of {total} "
                                  f"records ({empty / total:.0%} > --max-empty-fraction "
                                  f"{args.max_empty_fraction:g}); check the key, or raise the limit")


def write_records(records, encoder, prefixes, progress, workers=1, chunk_size=25, check=None):
    """Tokenize `records` and write one dataset per key at `prefixes[key]` (atomically)."""
    pool = fork_pool(workers, encoder) if workers > 1 else None
    try:
        results = pool.imap(encode_in_worker, records, chunk_size) if pool else map(encoder.encode, records)
        write_encoded(results, prefixes, encoder.dtype, lambda nbytes: progress.update(1, nbytes), check)
    finally:
        if pool is not None:
            stop_pool(pool)


def run(args):
    source, encoder, _ = prepare(args)
    prefixes = {key: output_prefix_for(args, key) for key in args.json_keys}
    print(f"Tokenizing {args.input} with {args.workers} worker(s) into "
          f"{', '.join(p + '.{bin,idx}' for p in prefixes.values())}", file=sys.stderr, flush=True)
    progress = Progress(source.total_bytes, source.total_docs, args.log_interval)
    try:
        write_records(source.records(), encoder, prefixes, progress, args.workers, args.chunk_size,
                      lambda counts: check_documents(args, counts))
    except BaseException:
        progress.close(summary=False)
        raise
    return progress.close()


def main(argv=None, parser_factory=None, runner=None):
    """CLI wrapper: bad input (and unreadable/unwritable files) becomes one line on stderr and exit status 2."""
    parser = (parser_factory or (lambda: build_parser("Tokenize a corpus into Megatron .bin/.idx.")))()
    args = parser.parse_args(argv)
    try:
        (runner or run)(args)
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130
    return 0

