"""The engines the side-by-side benchmarks compare: DeepSpeed's own two and every catalogued schedule."""
from __future__ import annotations

from megatron_ds.schedules import CATALOG

STOCK, DUALPIPEV = "DS 1F1B (stock)", "DS DualPipeV"


def engines(seq_splits=(2,), **seq_options) -> dict:
    """name -> the ds_config "pipeline" section that selects it (None: one of DeepSpeed's engines).
    Schedules that split the sequence get one engine per entry of `seq_splits`, with `seq_options`."""
    out = {STOCK: None, DUALPIPEV: None}
    for name, spec in CATALOG.items():
        for note, knobs in spec.variants(virtual_stages=2, seq_splits=seq_splits, split=False):
            extra = seq_options if spec.seq_splits else {}
            out[f"{name} {note}".strip()] = {"schedule": name, **knobs, **extra}
    return out


def unsupported(name, p, m) -> str | None:
    """Why engine `name` cannot run p stages with m micro-batches (None: it can)."""
    if name == DUALPIPEV and m < 2 * p:
        return "DeepSpeed's DualPipeV needs m >= 2p"
    return None
