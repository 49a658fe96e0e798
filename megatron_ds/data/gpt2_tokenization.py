"""GPT-2 byte-level BPE, reading OpenAI's `encoder.json`/`vocab.json` + `vocab.bpe`/`merges.txt`.

Same algorithm as OpenAI's encoder (and Megatron's gpt2_tokenization): text is
split by GPT-2's regex, each piece becomes printable "byte characters", and the
lowest-ranked merge is applied until none is left. `<|endoftext|>` in the text is
*not* special (Megatron does the same); append `eod` to end a document.
"""
import functools
import json
from itertools import chain

import regex

# GPT-2's pre-tokenizer: contractions, letters, numbers, other symbols, whitespace.
_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

# Bounded so long runs with many workers cannot grow memory without limit
# (BigScience hit exactly that with an unbounded cache).
BPE_CACHE_SIZE = 1 << 18


@functools.lru_cache(maxsize=None)
def bytes_to_unicode():
    """Map every byte to a printable unicode character (GPT-2's reversible table)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_merges(merges_file):
    """Merge pairs in rank order; the '#version' header and blank lines are skipped."""
    with open(merges_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{merges_file}: line {lineno}: expected two symbols, got {line!r}")
        merges.append(tuple(parts))
    return merges


class _PieceCache(dict):
    """piece -> token ids; a miss runs BPE. Cleared when full, which keeps memory bounded."""

    def __init__(self, compute, capacity):
        super().__init__()
        self._compute, self._capacity = compute, capacity

    def __missing__(self, piece):
        ids = self._compute(piece)
        if len(self) >= self._capacity:
            self.clear()
        self[piece] = ids
        return ids


class GPT2BPE:
    def __init__(self, vocab_file, merges_file, errors="replace"):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        # Bytes -> byte characters in one C call: decode as latin-1, then translate.
        self._byte_table = {b: ch for b, ch in self.byte_encoder.items()}
        self.bpe_ranks = {pair: i for i, pair in enumerate(read_merges(merges_file))}
        self._cache = _PieceCache(self._piece_ids, BPE_CACHE_SIZE)

    def _bpe_uncached(self, token):
        word = list(token)
        ranks = self.bpe_ranks
        while len(word) > 1:
            best, best_rank = None, None
            for pair in zip(word, word[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            first, second = best
            merged, i, n = [], 0, len(word)
            while i < n:
                if i < n - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        try:
            return tuple(self.encoder[piece] for piece in word)
        except KeyError as e:
            raise ValueError(f"BPE piece {e.args[0]!r} is not in the vocabulary: the vocab "
                             f"and merges files do not belong together") from None

    def encode(self, text):
        # Cache hits (most pieces of real text) never leave C: dict lookups chained into one list.
        return list(chain.from_iterable(map(self._cache.__getitem__, _SPLIT.findall(text))))

    def _piece_ids(self, piece):
        return self._bpe_uncached(piece.encode("utf-8").decode("latin-1").translate(self._byte_table))

    def decode(self, ids):
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors=self.errors)
