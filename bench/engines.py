"""The engines the side-by-side benchmarks compare: DeepSpeed's own two and every megatron_ds schedule."""
from __future__ import annotations

STOCK, DUALPIPEV = "DS 1F1B (stock)", "DS DualPipeV"


def engines(seq_splits=(2,), **seq1f1b_options) -> dict:
    """name -> the ds_config "pipeline" section that selects it (None: one of DeepSpeed's engines)."""
    out = {
        STOCK: None,
        DUALPIPEV: None,
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
        "interleaved v=2": {"schedule": "interleaved", "virtual_stages": 2},
        "zb-h1": {"schedule": "zb-h1"},
        "zb-h2": {"schedule": "zb-h2"},
        "zbv": {"schedule": "zbv"},
        "bitpipe": {"schedule": "bitpipe"},
    }
    for k in seq_splits:
        out[f"seq1f1b k={k}"] = {"schedule": "seq1f1b", "seq_splits": k, **seq1f1b_options}
    return out


def unsupported(name, p, m) -> str | None:
    """Why DeepSpeed's own engine `name` cannot run p stages with m micro-batches (None: it can)."""
    if name == DUALPIPEV and m < 2 * p:
        return "DeepSpeed's DualPipeV needs m >= 2p"
    return None
