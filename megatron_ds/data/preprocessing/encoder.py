"""Record -> token arrays, run in worker processes.

Megatron's rules: each --json-keys value is one document; a document that
tokenizes to nothing is dropped (even with --append-eod); --append-eod puts the
tokenizer's end-of-document id after the last token.
"""
import json

import numpy as np

from . import PreprocessError


class Encoder:
    def __init__(self, tokenizer, keys, append_eod, dtype):
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.append_eod = append_eod
        self.dtype = np.dtype(dtype)

    def encode(self, record):
        """(input bytes, {key: token array or None}) for one record."""
        location, payload = record
        if isinstance(payload, (bytes, bytearray)):
            nbytes = len(payload)
            try:
                data = json.loads(payload)
            except ValueError as e:
                raise PreprocessError(f"{location}: invalid JSON ({e})") from None
            if not isinstance(data, dict):
                raise PreprocessError(f"{location}: expected a JSON object, got {type(data).__name__}")
        else:
            data = payload
            nbytes = 0
        out = {}
        for key in self.keys:
            if key not in data:
                raise PreprocessError(f"{location}: no key {key!r} (keys: {sorted(data)[:10]}); "
                                      f"choose them with --json-keys")
            text = data[key]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise PreprocessError(f"{location}: value of {key!r} is a {type(text).__name__}, "
                                      f"expected a string")
            if not isinstance(payload, (bytes, bytearray)):
                nbytes += len(text.encode("utf-8"))
            ids = self.tokenizer.tokenize(text) if text else []
            if len(ids) and self.append_eod:
                ids = list(ids)
                ids.append(self.tokenizer.eod)
            out[key] = np.asarray(ids, dtype=self.dtype) if len(ids) else None
        return nbytes, out


# Set in the parent before forking workers; each forked worker inherits it.
_ENCODER = None


def set_worker_encoder(encoder):
    global _ENCODER
    _ENCODER = encoder


def encode_in_worker(record):
    return _ENCODER.encode(record)
