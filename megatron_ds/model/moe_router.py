"""The MoE router: scores, top-k choice of experts, capacity, and the load-balancing statistics.

Semantics are Megatron-core's (its flags in moe_config.MoEConfig): softmax over the top-k logits (or,
with pre_softmax, over all experts before the top-k), or sigmoid scores normalised over the chosen
experts; an optional per-expert bias that steers the choice but not the weights (DeepSeek-V3);
group-limited choice (the best groups first, by the sum of their top experts' scores); a capacity per
expert beyond which the lowest-probability assignments are dropped.

The load-balancing losses are linear in the router's scores once the token counts are fixed:
    aux_loss     = coeff * E / (k T^2) * sum_i c_i * sum_t s_ti                (c_i: tokens on expert i)
    seq_aux_loss = coeff * E / (k S^2 b) * sum_b sum_i c_bi * sum_{t in b} s_bti (per sequence, then mean)
    z_loss       = coeff / T * sum_t logsumexp(logits_t)^2
so a chunk of tokens contributes (score sums, z sum) and the counts of the whole micro-batch weigh them:
the router hands the layer a `RouterLossInputs`, and moe.RouterLosses turns it into gradients.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from megatron_ds.moe_config import MoEConfig
from .linear import linear


def top_experts(scores, m: MoEConfig):
    """(values, indices) of each token's top-k experts; group-limited when m.group_topk is set."""
    if not m.group_topk:
        return torch.topk(scores, m.router_topk, dim=-1)
    tokens, experts = scores.shape
    per_group = experts // m.num_groups
    grouped = scores.view(tokens, m.num_groups, per_group)
    group_scores = grouped.topk(m.router_topk // m.group_topk, dim=-1).values.sum(-1)
    chosen = group_scores.topk(m.group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = scores.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    return masked.topk(m.router_topk, dim=-1)


def route(logits, m: MoEConfig, expert_bias=None):
    """Each token's experts (T, k) and their weights (T, k, fp32) from the router's logits (T, E)."""
    if m.score_function == "softmax":
        if m.pre_softmax:
            probs, experts = top_experts(torch.softmax(logits.float(), dim=-1), m)
        else:
            top, experts = top_experts(logits.float(), m)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        _, experts = top_experts(scores if expert_bias is None else scores + expert_bias, m)
        probs = scores.gather(1, experts)
        if m.router_topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if m.topk_scaling_factor:
        probs = probs * m.topk_scaling_factor
    return probs, experts


def capacity_kept(probs, experts, m: MoEConfig, num_experts: int):
    """Which assignments (T, k) fit their expert's capacity, ceil(T k / E * factor): each expert keeps
    its highest-probability tokens (Megatron's "probs" drop policy). All of them when dropless."""
    tokens = experts.shape[0]
    capacity = math.ceil(tokens * m.router_topk / num_experts * m.capacity_factor) if m.capacity_factor else tokens
    if capacity >= tokens:
        return torch.ones_like(experts, dtype=torch.bool)
    dense = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device)
    dense.scatter_(1, experts, probs.detach())
    dense.masked_fill_(dense == 0, -1.0)  # a token not routed to an expert is never kept in its place
    kept_rows = dense.topk(capacity, dim=0).indices
    kept = torch.zeros_like(dense, dtype=torch.bool).scatter_(0, kept_rows, True)
    return kept.gather(1, experts)


@dataclass
class RouterLossInputs:
    """What a chunk of tokens adds to its micro-batch's router losses (see the module docstring).
    `score_sums` (E,) or, per sequence, (b, E) and `z_sum` carry gradients; `counts` (the same shape)
    are the chunk's load-balancing counts, `routed` (E,) the tokens the chunk sent to each expert."""
    score_sums: Optional[torch.Tensor]
    counts: Optional[torch.Tensor]
    z_sum: Optional[torch.Tensor]
    routed: torch.Tensor
    tokens: int  # the chunk's tokens, all sequences together
    sequences: int


def loss_inputs(logits, experts, kept, m: MoEConfig, batch: int) -> RouterLossInputs:
    """The chunk's loss inputs. The balancing scores are the unbiased ones over all experts (softmax, or
    sigmoid normalised per token) and their counts the plain top-k of those scores, as Megatron's."""
    num_experts = logits.shape[-1]
    routed = torch.bincount(experts[kept], minlength=num_experts).float()
    score_sums = counts = None
    if m.load_balancing_type != "none" and m.aux_loss_coeff > 0:
        if m.score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter_(1, scores.detach().topk(m.router_topk, dim=-1).indices, 1.0)
        if m.load_balancing_type == "seq_aux_loss":
            score_sums, counts = (t.view(batch, -1, num_experts).sum(1) for t in (scores, chosen))
        else:
            score_sums, counts = scores.sum(0), chosen.sum(0)
    z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum() if m.z_loss_coeff > 0 else None
    return RouterLossInputs(score_sums, counts, z_sum, routed, logits.shape[0], batch)


def aux_loss_weights(counts, tokens: int, sequences: int, m: MoEConfig):
    """d(aux loss) / d(score_sums) for a micro-batch's counts over its `tokens`: coeff * E / (k T^2) * c
    (per sequence: T = its S = tokens / sequences, and the mean over the sequences)."""
    num_experts = counts.shape[-1]
    if m.load_balancing_type == "seq_aux_loss":
        per_sequence = tokens // sequences
        return counts * (m.aux_loss_coeff * num_experts / (m.router_topk * per_sequence ** 2 * sequences))
    return counts * (m.aux_loss_coeff * num_experts / (m.router_topk * tokens * tokens))


class Router(nn.Module):
    """logits = x W^T (a deferrable linear: the B/W split defers its weight GEMM like any other), with
    the expert bias and the bias update's token counts as buffers when the bias is on."""

    def __init__(self, hidden_size: int, m: MoEConfig, init_method):
        super().__init__()
        self.config = m
        self.weight = nn.Parameter(torch.empty(m.num_experts, hidden_size))
        with torch.no_grad():
            init_method(self.weight)
        if m.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(m.num_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(m.num_experts), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None

    def forward(self, x2d):
        """(logits (T, E), probs (T, k), experts (T, k), kept (T, k))."""
        logits = linear(x2d, self.weight)
        probs, experts = route(logits, self.config, self.expert_bias)
        kept = capacity_kept(probs, experts, self.config, self.weight.shape[0])
        return logits, probs, experts, kept

    @torch.no_grad()
    def update_expert_bias(self, group=None):
        """After an optimizer step: bias += rate * sign(mean count - count), from the step's counts summed
        over `group` (the ranks that routed the rest of the global batch), the same on every rank."""
        if self.expert_bias is None:
            return
        counts = self.tokens_per_expert
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=self.config.bias_update_rate)
        counts.zero_()
