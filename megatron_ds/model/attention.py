"""Causal self-attention through torch's scaled_dot_product_attention.

One fused projection c_attn gives [q (heads x d); k (kv heads x d); v (kv heads x d)], d the head size
(hidden / heads, or --kv-channels: then q and the output c_proj takes back are heads x d wide, not hidden):
with grouped-query attention (fewer K/V heads) each K/V head serves heads / kv heads
query heads, and K/V stay grouped all the way (SDPA's enable_gqa; the Seq1F1B cache
holds the grouped heads). With --qk-layernorm each query and key head is normalised over
head_dim first (Qwen3's q_norm/k_norm), before RoPE rotates q and k; ALiBi is an additive bias.
Packed documents (--reset-attention-mask) attend within each document (documents.py). Under selective
recompute the core (mask, scores, softmax, dropout, weighted sum) is attended again in backward (recompute.py).

With tensor parallelism each rank projects, attends with and projects back its own
query heads and their K/V heads (c_attn column-parallel by sections, c_proj row-parallel).
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from .documents import Documents, documents_attention, documents_rope_tables
from .kv_cache import KVSlot, SegmentKVCache, queries_reversed, segment_outputs, segment_queries
from .norm import HeadNorm
from .positions import alibi_bias, rope_tables, rotate
from .recompute import recomputed
from .tensor_parallel import ColumnParallelLinear, Dropout, RowParallelLinear, comm, get_rng_tracker, tensor_parallel_group


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig, init_method=None, output_init_method=None):
        """The init methods fill the full c_attn and c_proj weights (each rank keeps its slice); a
        standalone module (no TransformerLayer around it) draws them from config.seed."""
        super().__init__()
        if init_method is None:
            gen = torch.Generator().manual_seed(config.seed)
            init_method = output_init_method = lambda w: w.normal_(0.0, config.init_method_std, generator=gen)
        self.group = tensor_parallel_group(config)
        tp = config.tensor_model_parallel_size
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads // tp,
                                                            config.num_key_value_heads // tp, config.head_dim)
        q_size, kv_size = config.query_projection_size, config.num_key_value_heads * self.head_dim
        parallel = dict(group=self.group, sequence_parallel=config.sequence_parallel, bias=config.add_bias_linear)
        self.c_attn = ColumnParallelLinear(config.hidden_size, q_size + 2 * kv_size,
                                           sections=[q_size, kv_size, kv_size], init_method=init_method,
                                           **parallel)
        self.c_proj = RowParallelLinear(q_size, config.hidden_size, init_method=output_init_method, **parallel)
        self.q_norm, self.k_norm = (HeadNorm(config), HeadNorm(config)) if config.qk_layernorm else (None, None)
        self.split_sizes = [s // tp for s in self.c_attn.sections]
        self.total_heads, self.head_start = config.num_attention_heads, comm.rank(self.group) * self.num_heads
        self.position_embedding_type, self.rope_theta = config.position_embedding_type, config.rope_theta
        self.rope_scaling = config.rope_scaling  # frozen and hashable: the tables are cached by it
        self.attention_dropout = config.attention_dropout
        self.resid_drop = Dropout(config.hidden_dropout, partitioned=config.sequence_parallel)
        self.kv_slot = KVSlot()  # where the runtime puts this layer's K/V buffers of the open Seq1F1B segment
        self.recompute_core = config.recompute_granularity == "selective"

    def forward(self, x):
        qkv = self.c_attn(x)
        b, s = qkv.shape[:2]  # the whole sequence, also when x is a sequence-parallel shard
        q, k, v = qkv.split(self.split_sizes, dim=2)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k, v = (t.view(b, s, self.num_kv_heads, self.head_dim) for t in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        segmented = SegmentKVCache.opened  # a sequence segment (Seq1F1B): also attend to the earlier segments
        if self.position_embedding_type == "rope":
            start = SegmentKVCache.current().offset if segmented else 0  # a compiled layer: a graph per offset
            tables = documents_rope_tables if Documents.positioning else rope_tables
            q, k = rotate(q, k, *tables(self.head_dim, self.rope_theta, start, s, q.device, q.dtype,
                                        self.rope_scaling))
        y = self._attend_through_cache(segment_queries(q), k, v) if segmented else self._core(q, k, v)
        return self._project(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim), segmented)

    def _attend(self, q, k, v, mask):
        dropout = self.attention_dropout if self.training else 0.0
        # each rank's heads drop their own elements
        rng = get_rng_tracker().fork() if self.group is not None and dropout else contextlib.nullcontext()
        with rng:
            return F.scaled_dot_product_attention(q, k, v, **mask, dropout_p=dropout,
                                                  enable_gqa=self.num_kv_heads != self.num_heads)

    def _project(self, y, segmented):
        """c_proj and the dropout act per token: a segment runs them in its queries' order (no copy
        of y to save) and restores position order after; under sequence parallelism before them,
        as c_proj scatters the sequence over the ranks."""
        if not segmented:
            return self.resid_drop(self.c_proj(y))
        if self.c_proj.sequence_parallel:
            return self.resid_drop(self.c_proj(segment_outputs(y)))
        return segment_outputs(self.resid_drop(self.c_proj(y)))

    def _attend_through_cache(self, q, k, v):
        """Attention of the open segment's queries q, already in their order (segment_queries), to the
        keys/values of its own and every earlier position (b, heads, s, head_dim)."""
        k, v = SegmentKVCache.current().extend(self.kv_slot, k, v)
        return self._core(q, k, v)

    def _core(self, q, k, v):
        """The attention core of q to k, v (the open segment's, whose keys start at position 0), kept for backward
        or, under selective recompute, attended again there: q, k, v are all it keeps."""
        if self.recompute_core:
            return recomputed(self._masked_attention, q, k, v)
        return self._masked_attention(q, k, v)

    def _masked_attention(self, q, k, v):
        """Causal attention, within documents when packed (--reset-attention-mask); its masks made here, so that
        a recomputed core holds none between forward and backward."""
        segment = SegmentKVCache.current() if SegmentKVCache.opened else None
        if Documents.masking:  # its own recomputation only where the core keeps its groups' outputs
            start, reversed_queries = (segment.offset, queries_reversed(q.device)) if segment else (0, False)
            return documents_attention(q, k, v, start, reversed_queries, self._attend, self._document_bias(),
                                       self._recomputable() and not self.recompute_core)
        return self._attend(q, k, v, self._mask(q, k, segment))

    def _recomputable(self):
        """Whether attending again in backward draws the same dropout masks: torch's RNG is restored by the
        recomputation, the tensor-parallel tracker's is not."""
        return not (self.training and self.attention_dropout and self.group is not None)

    def _document_bias(self):
        """ALiBi's bias of this rank's heads for document attention's groups (documents.py), else None."""
        if self.position_embedding_type != "alibi":
            return None
        heads = slice(self.head_start, self.head_start + self.num_heads)
        return lambda lq, lk, reversed_queries, dtype, device: alibi_bias(self.total_heads, lq, lk, dtype, device,
                                                                          reversed_queries)[heads]

    def _mask(self, q, k, segment):
        """SDPA's mask arguments: causal (bottom-right aligned for a segment), plus ALiBi's bias."""
        if self.position_embedding_type == "alibi":
            reversed_queries = segment is not None and queries_reversed(q.device)
            bias = alibi_bias(self.total_heads, q.shape[-2], k.shape[-2], q.dtype, q.device, reversed_queries)
            return dict(attn_mask=bias[self.head_start:self.head_start + self.num_heads])
        mask = segment.causal_mask(q, k) if segment is not None else None
        return dict(attn_mask=mask, is_causal=mask is None)
