"""The GPT's layers under vocabulary parallelism (docs/SCHEDULES.md: Vocabulary parallelism): the
word embedding and the output layer leave the pipeline's layer list, every pipeline rank holds one
vocabulary slice of them (VocabSlice), and the first layer starts from the word embeddings summed
over the slices (EmbeddingSum). The passes that use the slices are model/vocab_parallel.py's.

Each slice holds the rows of the whole matrix that Embedding and LMHead draw without TP, so any
pipeline and TP size starts from the single-process reference's weights; the whole matrix is never
made (`normal_rows`). With TP, pipeline rank j's
block of V/p rows is cut again over its TP ranks (rank t: the block's t-th V/(p TP) rows, as the TP
layers split a vocabulary), and the first stage takes the slices' sum as the TP Embedding takes its
own: under SP as this rank's shard of the tokens.
"""

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec

from megatron_ds.gpt_config import GPTConfig
from .gpt import TIED_ATTR, TIED_KEY
from .layers import Embedding, FinalNorm, TransformerLayer, _generator
from .tensor_parallel import comm, gather_from_sequence, mark_parallel, scatter_to_sequence, tensor_parallel_group
from .vocab_parallel import vocab_range

ATTR = "vocab_slice"  # the pipeline module's attribute (pipe/build.py): its parameters are named ATTR.wte, ATTR.head


class EmbeddingSum(Embedding):
    """Layer 0 without its word embedding: input (word embeddings, the slices' sum; position_ids)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)  # draws the word embedding first, as the reference does
        del self.wte

    def forward(self, inputs):
        x, position_ids = inputs
        if self.wpe is None and self.ln_emb is None:  # under SP x is already this rank's shard
            return self.drop(x)
        if self.sequence_parallel:  # positions and the norm see every token, as in Embedding
            x = gather_from_sequence(x, self.group, tensor_parallel_output_grad=False)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        if self.ln_emb is not None:
            x = self.ln_emb(x)
        if self.sequence_parallel:
            x = scatter_to_sequence(x, self.group)
        return self.drop(x)


class VocabSlice(nn.Module):
    """Rows [start, end) of the word embedding (`wte`) and of the untied output layer (`head`; None
    when tied: the output layer is `wte`): pipeline rank `rank` of `world`'s block, or with TP this
    TP rank's part of it (`group`: the TP group, None without)."""

    def __init__(self, config: GPTConfig, rank: int, world: int):
        super().__init__()
        self.group, self.sequence_parallel = tensor_parallel_group(config), config.sequence_parallel
        tp = comm.world_size(self.group)
        self.start, self.end = vocab_range(config.vocab_size, rank * tp + comm.rank(self.group), world * tp)
        shape, std = (config.vocab_size, config.hidden_size), config.init_method_std
        # the generators of Embedding (layer 0: its word table first) and of the untied LMHead (layer L+2)
        self.wte = nn.Parameter(normal_rows(shape, self.start, self.end, std, _generator(config, 0)))
        self.head = None
        if not config.tied_head:
            self.head = nn.Parameter(normal_rows(shape, self.start, self.end, std,
                                                 _generator(config, config.num_layers + 2)))
        self.loss_chunk_size = config.loss_chunk_size  # S and T a chunk of tokens at a time (0: all at once)
        for p in self.parameters():  # each TP rank's rows differ: the gradient norm counts them all
            mark_parallel(p, 0, self.group)
        self.names = whole_names(config)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.wte if self.head is None else self.head


CHUNK_ROWS = 4096  # a multiple of 16 (normal_rows)


def normal_rows(shape: tuple, start: int, end: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """Rows [start, end) of torch.empty(shape).normal_(0, std, generator=generator), without the whole
    matrix: the rows are filled in chunks, in order, from the same generator, and those before `start`
    dropped. torch's CPU normal_ turns uniform draws into normals 16 at a time (its last 16 from fresh
    draws when the size is no multiple of 16), so chunks of a multiple of 16 rows, the last (merged into
    its predecessor if under 16 numbers) ending the matrix, fill what the whole fill would (the slices
    equal the single-process model's weights in tests/pipe/vocab/test_vocab_engine.py)."""
    rows, width = shape
    bounds = list(range(0, rows, CHUNK_ROWS)) + [rows]
    if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * width < 16:
        del bounds[-2]
    out = torch.empty(end - start, width)
    for a, b in zip(bounds, bounds[1:]):
        if a >= end:
            break
        chunk = torch.empty(b - a, width).normal_(0.0, std, generator=generator)
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            out[lo - start:hi - start] = chunk[lo - a:hi - a]
    return out


def whole_names(config: GPTConfig) -> dict:
    """How this layout's parameter names read in the layout without vocabulary parallelism (gpt_layer_specs
    under DeepSpeed's PipelineModule), which is how the optimizer state is matched across layouts
    (training/checkpoint/relayout.py): "slices" {slice parameter: the whole one it is rows of}, "prefixes" {prefix:
    its replacement} (tied, layer 0 is a tied module there). Plain data: checkpoints record it."""
    if config.tied_head:
        tied = f"tied_modules.{TIED_KEY}."
        return {"slices": {f"{ATTR}.wte": tied + TIED_ATTR}, "prefixes": {"0.": tied}}
    return {"slices": {f"{ATTR}.wte": "0.wte.weight", f"{ATTR}.head": f"{config.num_layers + 2}.weight"},
            "prefixes": {}}


def whole_name(name: str, names: dict | None) -> str:
    """`name` as the layout without vocabulary parallelism has it (`names`: whole_names'; None: unchanged)."""
    if not names:
        return name
    if name in names["slices"]:
        return names["slices"][name]
    for prefix, replacement in names["prefixes"].items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def vocab_layer_specs(config: GPTConfig):
    """The pipeline's layers when the vocabulary slices sit beside them: the GPT's without the output
    layer, the embedding without its word table (global indices as gpt_layer_specs')."""
    L = config.num_layers
    return ([LayerSpec(EmbeddingSum, config, 0)] + [LayerSpec(TransformerLayer, config, i) for i in range(1, L + 1)]
            + [LayerSpec(FinalNorm, config, L + 1)])
