"""The model and batch flags the GPT benches share, spelled as Megatron spells them."""
from __future__ import annotations

FLAGS = {  # dest -> (type, help)
    "pp": (int, "pipeline stages (one rank each)"),
    "gas": (int, "micro-batches per iteration (m)"),
    "micro_batch_size": (int, "sequences per micro-batch"),
    "seq_length": (int, "tokens per sequence"),
    "hidden_size": (int, "hidden size"),
    "num_layers": (int, "transformer layers"),
    "num_attention_heads": (int, "attention heads"),
    "vocab_size": (int, "vocabulary size"),
}


def add_model_args(parser, **defaults):
    """Adds --pp, --gas, --micro-batch-size, ... for each keyword given, with that default."""
    for dest, default in defaults.items():
        kind, text = FLAGS[dest]
        parser.add_argument("--" + dest.replace("_", "-"), type=kind, default=default, help=text)
    return parser
