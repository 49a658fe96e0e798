"""The GPT layers, one class per pipeline layer. nanoGPT-shaped; no pipeline logic.

A pipeline is the list [Embedding, TransformerLayer x L, FinalNorm, LM head (the
Embedding again when tied, else LMHead)]; the single-process reference chains the
same classes. The model families are options on these classes (see megatron_ds/gpt_config.py).
Each layer initialises itself from its own seed (config.seed + global layer
index), so any partition into pipeline stages gives the same weights; with tensor
parallelism (config.tensor_model_parallel_size) each rank draws the full matrices
and keeps its slice, so any TP size gives the same weights too. With TP the LM head
returns this rank's vocabulary slice of the logits (loss: loss_function(config)).
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention
from megatron_ds.gpt_config import GPTConfig
from .chunked_loss import chunked_linear_cross_entropy
from .compile import compile_loss
from .moe import MoE, mlp_activation
from .norm import Norm
from .tensor_parallel import (ColumnParallelLinear, Dropout, RowParallelLinear, VocabParallelEmbedding,
                              column_parallel_linear, copy_to_region, gather_from_sequence, scatter_to_sequence,
                              tensor_parallel_group, vocab_parallel_loss)


def _generator(config: GPTConfig, layer_idx: int):
    return torch.Generator().manual_seed(config.seed + layer_idx)


def _normal(std: float, gen: torch.Generator):
    """An init method: fills a full weight in place (biases start at zero)."""
    return lambda weight: weight.normal_(0.0, std, generator=gen)


def _mark_sequence_parallel(module, config):
    """A norm on a sequence shard sees only its tokens: its gradient is summed over the TP group."""
    for p in module.parameters():
        p.sequence_parallel = config.sequence_parallel


class Embedding(nn.Module):
    """Word embeddings, learned absolute position embeddings (rope and alibi act in attention
    instead), optionally a norm after them (BLOOM). Input: (tokens, position_ids)."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        gen = _generator(config, layer_idx)
        self.group, self.sequence_parallel = tensor_parallel_group(config), config.sequence_parallel
        self.hands_weight = config.head_hands_weight  # as the tied head (lm_head)
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=self.group,
                                          init_method=_normal(config.init_method_std, gen))
        learned = config.position_embedding_type == "learned_absolute"
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        self.ln_emb = Norm(config) if config.embed_layernorm else None
        self.drop = Dropout(config.hidden_dropout, partitioned=config.sequence_parallel)
        if self.wpe is not None:
            with torch.no_grad():
                self.wpe.weight.normal_(0.0, config.init_method_std, generator=gen)

    def forward(self, inputs):
        tokens, position_ids = inputs
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        if self.ln_emb is not None:
            x = self.ln_emb(x)
        if self.sequence_parallel:  # the residual stream is split by sequence from here on
            x = scatter_to_sequence(x, self.group)
        return self.drop(x)


class TiedLMHead(nn.Module):
    """The LM head's copy of the word embedding, on a rank that lacks the Embedding.

    It holds only `wte` (a stage without the embedding has no use for positions),
    initialised exactly like Embedding.wte; DeepSpeed keeps the two copies tied.
    """

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.group, self.sequence_parallel = tensor_parallel_group(config), config.sequence_parallel
        self.hands_weight = config.head_hands_weight
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=self.group,
                                          init_method=_normal(config.init_method_std, _generator(config, layer_idx)))


def lm_head(embedding, hidden):
    """The tied LM head is the word embedding, transposed (with TP: this rank's vocabulary rows)."""
    if embedding.hands_weight:
        return head_input(hidden, embedding.group, embedding.sequence_parallel), embedding.wte.weight
    if embedding.group is None:
        return F.linear(hidden, embedding.wte.weight)
    return column_parallel_linear(hidden, embedding.wte.weight, None, embedding.group, embedding.sequence_parallel)


def head_input(hidden, group, sequence_parallel):
    """What a chunked head multiplies (--loss-chunk-size): the hidden states as a column-parallel linear
    sees them (its input gradient summed over the TP group; under SP the sequence gathered)."""
    if sequence_parallel:
        return gather_from_sequence(hidden, group)
    return copy_to_region(hidden, group)


class LMHead(ColumnParallelLinear):
    """The untied LM head (--untie-embeddings-and-output-weights): a pipeline layer of its own,
    whose weight GEMM a B/W split defers like any other linear layer's. With --loss-chunk-size it
    hands (hidden, weight) to the loss, which multiplies them a chunk of tokens at a time."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__(config.hidden_size, config.vocab_size, bias=False, group=tensor_parallel_group(config),
                         sequence_parallel=config.sequence_parallel,
                         init_method=_normal(config.init_method_std, _generator(config, layer_idx)))
        self.hands_weight = config.head_hands_weight

    def forward(self, x):
        if self.hands_weight:
            return head_input(x, self.group, self.sequence_parallel), self.weight
        return super().forward(x)


class MLP(nn.Module):
    """GELU (tanh approximation), or SwiGLU: c_fc gives [gate; up], silu(gate) * up goes to c_proj."""

    def __init__(self, config: GPTConfig, init_method, output_init_method, ffn_hidden_size=None):
        """c_fc column-parallel (SwiGLU: each rank its slice of gate and the same slice of up), c_proj
        row-parallel. ffn_hidden_size: config's unless given (a MoE layer's shared expert)."""
        super().__init__()
        self.swiglu = config.swiglu
        ffn = ffn_hidden_size or config.ffn_hidden_size
        parallel = dict(group=tensor_parallel_group(config), sequence_parallel=config.sequence_parallel,
                        bias=config.add_bias_linear)
        self.c_fc = ColumnParallelLinear(config.hidden_size, 2 * ffn if self.swiglu else ffn,
                                         sections=[ffn, ffn] if self.swiglu else None, init_method=init_method,
                                         **parallel)
        self.c_proj = RowParallelLinear(ffn, config.hidden_size, init_method=output_init_method, **parallel)
        self.drop = Dropout(config.hidden_dropout, partitioned=config.sequence_parallel)

    def forward(self, x):
        return self.drop(self.c_proj(mlp_activation(self.c_fc(x), self.swiglu)))


class TransformerLayer(nn.Module):
    """Pre-norm GPT block."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        gen = _generator(config, layer_idx)  # drawn in order: c_attn, attn.c_proj, c_fc, mlp.c_proj
        init = _normal(config.init_method_std, gen)
        scaled_init = _normal(config.init_method_std / math.sqrt(2.0 * config.num_layers), gen)  # GPT-2's scaling
        self.ln_1 = Norm(config)
        self.attn = CausalSelfAttention(config, init, scaled_init)
        self.ln_2 = Norm(config)
        self.mlp = MoE(config, init, scaled_init, layer_idx, shared_expert=_shared_expert(config, init, scaled_init)) \
            if config.is_moe_layer(layer_idx) else MLP(config, init, scaled_init)
        _mark_sequence_parallel(self.ln_1, config)
        _mark_sequence_parallel(self.ln_2, config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _shared_expert(config, init_method, output_init_method):
    """A MoE layer's expert every token passes through (--moe-shared-expert-intermediate-size), split over
    the TP ranks as the dense MLP is."""
    size = config.moe.shared_expert_intermediate_size
    return MLP(config, init_method, output_init_method, ffn_hidden_size=size) if size else None


class FinalNorm(Norm):
    """The norm after the last transformer layer: a pipeline layer of its own."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        _mark_sequence_parallel(self, config)


def gpt_loss(logits, labels):
    """Mean token cross-entropy, computed in fp32 as Megatron does.

    `labels` is a tensor, or (labels, num_tokens) when a micro-batch is split into
    sequence segments: each segment's loss is then divided by the whole
    micro-batch's token count, so the segment losses sum to the full loss. A label of
    documents.IGNORE (--eod-mask-loss) is not scored, nor counted in the mean (it is
    cross_entropy's ignore_index).
    """
    if isinstance(labels, (tuple, list)):
        labels, num_tokens = labels
        losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
        return losses / num_tokens
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())


def loss_function(config: GPTConfig):
    """gpt_loss, or with tensor parallelism its vocab-parallel twin over the TP group; with
    --loss-chunk-size the chunked head + loss on the head's (hidden, weight)."""
    group = tensor_parallel_group(config)
    if config.liger_kernel:
        return liger_head_loss
    if config.loss_chunk_size:
        return functools.partial(chunked_head_loss, chunk=config.loss_chunk_size, group=group)
    return gpt_loss if group is None else functools.partial(vocab_parallel_loss, group=group)


def compiled_loss(loss_fn):
    """What "pipeline.compile_layers" makes of a loss loss_function returned: gpt_loss a compiled region of
    its own, the chunked head + loss with the arithmetic between its GEMMs compiled; the vocab-parallel
    loss (collectives) and Liger's (its own kernels) as they are."""
    if loss_fn is gpt_loss:
        return compile_loss(gpt_loss)
    if isinstance(loss_fn, functools.partial) and loss_fn.func is chunked_head_loss:
        return functools.partial(loss_fn, compiled=True)
    return loss_fn


def chunked_head_loss(outputs, labels, chunk, group=None, compiled=False):
    """The loss of a chunked head's (hidden, weight): gpt_loss of hidden @ weight^T, never whole."""
    hidden, weight = outputs
    return chunked_linear_cross_entropy(hidden, weight, labels, chunk, group, compiled)


def liger_head_loss(outputs, labels):
    """The loss of the head's (hidden, weight) by Liger-Kernel's fused linear cross-entropy (--use-liger-kernel):
    Triton kernels that make the gradients chunk by chunk in the forward, fp32 accumulation. Summed, then
    scaled as gpt_loss: by the scored token count (a Seq1F1B segment: the micro-batch's; IGNORE labels are
    Liger's ignore_index too)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # lazy: an optional CUDA extra
    hidden, weight = outputs
    labels, num_tokens = labels if isinstance(labels, (tuple, list)) else (labels, (labels >= 0).sum())
    fused = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)
    return fused(weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)) / num_tokens
