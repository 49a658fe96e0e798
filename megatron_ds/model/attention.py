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

With context parallelism (context_parallel_group(config) not None) a rank holds its chunks of the sequence (or
of the open Seq1F1B segment): RoPE rotates q and k by their global positions (or the documents' restarted ones
there), and attention runs over the CP group by --cp-comm-type (context_parallel/attend.py; a2a+p2p over its
inner and outer groups); everything else of the layer acts per token and is unchanged.
"""
import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from .context_parallel import ContextLayout, context_parallel_group, context_parallel_levels, context_parallel_registered
from .context_parallel.a2a import heads_problem
from .context_parallel.attend import context_parallel_attention, prefix_attention
from .documents import Documents, context_parallel_rope_tables, documents_attention, documents_rope_tables
from .kv_cache import KVSlot, SegmentKVCache, queries_reversed, segment_outputs, segment_queries
from .norm import HeadNorm
from .positions import alibi_bias, alibi_slopes, rope_tables, rotate
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
        self.bias_heads = slice(self.head_start, self.head_start + self.num_heads)  # of ALiBi's, this rank's
        self.context_parallel_size, self.cp_comm_type = config.context_parallel_size, config.cp_comm_type
        self._cp_config, self._cp_group = None, None
        if self.context_parallel_size > 1:
            if context_parallel_registered():
                self._init_context_parallel(config)
            else:  # a user's own PipelineModule is built before megatron_ds.initialize registers the CP group
                self._cp_config = config

    @property
    def cp_group(self):
        """The CP group attention exchanges K/V over (None without CP); taken from the registry when the layer
        was built before it (at the first forward: a missing or other-sized group is refused then)."""
        if self._cp_config is not None:
            config, self._cp_config = self._cp_config, None
            self._init_context_parallel(config)
        return self._cp_group

    def _init_context_parallel(self, config):
        self._cp_group = context_parallel_group(config)
        self.cp_layout = ContextLayout.of(self._cp_group)
        self.cp_levels = None
        if self.cp_comm_type == "a2a+p2p":  # the all-to-all's inner group and the ring's outer one
            self.cp_levels = context_parallel_levels(config.hierarchical_context_parallel_sizes)
        if self.cp_comm_type in ("a2a", "a2a+p2p"):  # GPTConfig checks it too; a layer built otherwise must not
            # attend wrongly
            heads_group = self.cp_layout if self.cp_levels is None else ContextLayout.of(self.cp_levels[0])
            problem = heads_problem(self.num_kv_heads, heads_group.size, inner=self.cp_levels is not None)
            if problem:
                raise ValueError(problem)
            per_rank = self.num_heads // heads_group.size  # the head group this rank attends after the all-to-all
            first = self.head_start + heads_group.rank * per_rank
            self.bias_heads = slice(first, first + per_rank)
        self.cp_slopes = None
        if self.position_embedding_type == "alibi" and self.cp_comm_type in ("p2p", "a2a+p2p"):
            self.cp_slopes = torch.tensor(alibi_slopes(self.total_heads), dtype=torch.float32)[self.bias_heads]

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
        if self.cp_group is not None:
            y = self._context_parallel(q, k, v, segmented)
            return self._project(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim), False)
        if self.position_embedding_type == "rope":
            start = SegmentKVCache.current().offset if segmented else 0  # a compiled layer: a graph per offset
            tables = documents_rope_tables if Documents.positioning else rope_tables
            q, k = rotate(q, k, *tables(self.head_dim, self.rope_theta, start, s, q.device, q.dtype,
                                        self.rope_scaling))
        y = self._attend_through_cache(segment_queries(q), k, v) if segmented else self._core(q, k, v)
        return self._project(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim), segmented)

    def _context_parallel(self, q, k, v, segmented):
        """This rank's attention output (b, heads, s, d) of its chunks, over the CP group (the module's docstring)."""
        segment = SegmentKVCache.current() if segmented else None
        length = q.shape[2] * self.cp_layout.size  # of the sequence, or of the open segment
        start = segment.offset if segment is not None else 0
        if self.position_embedding_type == "rope":
            q, k = rotate(q, k, *context_parallel_rope_tables(self.head_dim, self.rope_theta, self.cp_layout, length,
                                                              start, q.device, q.dtype, self.rope_scaling))
        extend = None
        if segment is not None:
            def extend(k, v, share):
                return segment.extend(self.kv_slot, k, v, share)
        core = functools.partial(prefix_attention, sdpa=self._attend, bias=self._document_bias(),
                                 recompute_documents=self._recomputable() and not self.recompute_core)
        slopes = None if self.cp_slopes is None else self.cp_slopes.to(q.device)
        dropout = self.attention_dropout if self.training else 0.0
        # p2p draws its dropout masks' seed here, each tensor-parallel rank's heads their own (allgather and a2a
        # fork the tracker around their SDPA calls, _attend: never twice at once, which would replay its state)
        p2p_fork = self.group is not None and dropout and self.cp_comm_type in ("p2p", "a2a+p2p")
        rng = get_rng_tracker().fork() if p2p_fork else contextlib.nullcontext()
        with rng:
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type,
                                              segment.spans if segment is not None else ((0, length),), core, extend,
                                              recomputed if self.recompute_core else None, slopes, dropout,
                                              levels=self.cp_levels)

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
        heads = self.bias_heads
        return lambda lq, lk, reversed_queries, dtype, device: alibi_bias(self.total_heads, lq, lk, dtype, device,
                                                                          reversed_queries)[heads]

    def _mask(self, q, k, segment):
        """SDPA's mask arguments: causal (bottom-right aligned for a segment), plus ALiBi's bias."""
        if self.position_embedding_type == "alibi":
            reversed_queries = segment is not None and queries_reversed(q.device)
            bias = alibi_bias(self.total_heads, q.shape[-2], k.shape[-2], q.dtype, q.device, reversed_queries)
            return dict(attn_mask=bias[self.bias_heads])
        mask = segment.causal_mask(q, k) if segment is not None else None
        return dict(attn_mask=mask, is_causal=mask is None)
