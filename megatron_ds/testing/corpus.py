"""A tiny Megatron .bin/.idx corpus written byte by byte (MMIDIDX, uint16), for training tests."""
import struct

import numpy as np


def write_corpus(prefix, num_docs=60, vocab=50257, seed=0):
    """Documents of 20..120 random tokens, each ending with <|endoftext|> (50256)."""
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(num_docs):
        doc = rng.randint(0, 1000, size=rng.randint(20, 120)).astype(np.uint16)  # a small active vocabulary
        docs.append(np.append(doc, np.uint16(vocab - 1)))
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype(np.int64)
    doc_idx = np.arange(num_docs + 1, dtype=np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(d.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8))  # uint16
        f.write(struct.pack("<Q", num_docs))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())
    return prefix
