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
import argparse
import random
import time

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


def measure(make, docs, repeat):
    best_cpu = best_wall = None
    for _ in range(repeat):
        encode = make()
        wall, cpu = time.perf_counter(), time.process_time()
        ids = encode(docs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best_cpu = cpu if best_cpu is None else min(best_cpu, cpu)
        best_wall = wall if best_wall is None else min(best_wall, wall)
    return ids, best_cpu, best_wall


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=2)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    vocab, merges = default_gpt2_files()
    print(f"| {'corpus':8s} | {'encoder':31s} | {'tokens/CPU s':>12s} | {'tokens/s wall':>13s} | "
          f"{'ours / this (CPU)':>17s} |")
    print(f"|{'-' * 10}|{'-' * 33}|{'-' * 14}|{'-' * 15}|{'-' * 19}|")
    for corpus, docs in (("prose", prose(a.mb)), ("unseen", unseen(a.mb))):
        reference, ours_rate = None, None
        for name, make in encoders(vocab, merges).items():
            ids, cpu, wall = measure(make, docs, a.repeat)
            reference = reference or ids
            assert ids == reference, f"{corpus}: {name} gives other ids"
            tokens = sum(map(len, ids))
            ours_rate = ours_rate or tokens / cpu
            print(f"| {corpus:8s} | {name:31s} | {tokens / cpu:12,.0f} | {tokens / wall:13,.0f} | "
                  f"{ours_rate / (tokens / cpu):16.2f}x |")
    print(f"({a.mb} MB per corpus, best of {a.repeat}, a fresh tokenizer each time; ids identical in every row)")


if __name__ == "__main__":
    main()
