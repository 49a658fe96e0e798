#!/usr/bin/env python
"""GPT-2 BPE encoding speed, cold cache: our GPT2BPETokenizer vs HF `tokenizers` on the same files.

    python -m bench.bpe_throughput [--mb 2] [--repeat 3]

Each repeat builds a fresh tokenizer (an empty cache, as in a new preprocessing run) and encodes the
documents one by one, as tools/preprocess_data.py does; HF also gets encode_batch_fast (Rayon threads
over the batch, no offsets). Two corpora: English prose (Python's pydoc topics, repeated to --mb MB) and
"unseen" text whose words are glued to random suffixes, so most pieces miss any cache. Prints tokens per
CPU second (this process, all threads; what does not depend on the machine's load) and per wall second,
best of --repeat, and checks every id list is equal.
"""
import random
import time

from bench import harness
from megatron_ds.data.tokenizer import GPT2BPETokenizer, default_gpt2_files


def prose(megabytes):
    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    out, size = [], 0
    while size < megabytes * 1e6:
        out.append(docs[len(out) % len(docs)])
        size += len(out[-1].encode())
    return out


def unseen(megabytes, seed=0):
    from pydoc_data.topics import topics
    rng = random.Random(seed)
    words = " ".join(topics[k] for k in sorted(topics)).split()
    out, size = [], 0
    while size < megabytes * 1e6:
        doc = " ".join(w + rng.choice(["", "ing", "s", str(rng.randint(0, 99999)), "_" + rng.choice(words)])
                       for w in rng.sample(words, 300))
        out.append(doc)
        size += len(doc.encode())
    return out


def hf_tokenizer(vocab, merges):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def encoders(vocab, merges):
    def ours():
        tok = GPT2BPETokenizer(vocab, merges)
        return lambda docs: [tok.tokenize(d) for d in docs]

    def hf_encode():
        tok = hf_tokenizer(vocab, merges)
        return lambda docs: [tok.encode(d).ids for d in docs]

    def hf_batch():
        tok = hf_tokenizer(vocab, merges)
        return lambda docs: [e.ids for e in tok.encode_batch_fast(docs)]
    return {"ours (GPT2BPETokenizer)": ours, "HF tokenizers encode": hf_encode,
            "HF tokenizers encode_batch_fast": hf_batch}


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--mb", type=float, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    out = harness.Report(a.perf_file, "bench.bpe_throughput", argv)
    vocab, merges = default_gpt2_files()
    out(*harness.table(["corpus", "encoder", "tokens/CPU s", "tokens/s wall", "ours / this (CPU)"], "llrrr", []))
    for corpus, docs in (("prose", prose(a.mb)), ("unseen", unseen(a.mb))):
        reference, ours_rate = None, None
        for name, make in encoders(vocab, merges).items():
            cpu, wall, ids = harness.best_of(lambda encode: encode(docs), a.repeat, make,
                                             (time.process_time, time.perf_counter))
            reference = reference or ids
            assert ids == reference, f"{corpus}: {name} gives other ids"
            tokens = sum(map(len, ids))
            ours_rate = ours_rate or tokens / cpu
            out(harness.row([corpus, name, f"{tokens / cpu:,.0f}", f"{tokens / wall:,.0f}",
                             f"{ours_rate / (tokens / cpu):.2f}x"]))
    out(f"({a.mb} MB per corpus, best of {a.repeat}, a fresh tokenizer each time; ids identical in every row)")
    out.save()


if __name__ == "__main__":
    main()
