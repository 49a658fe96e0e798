"""The pipeline layers a Hugging Face causal LM is cut into, each around the model's own modules (so the weights
are the model's, not copies): the token embedding, one layer per decoder layer, the final norm, the output layer.

Between stages travel the hidden states and the position ids (an integer tensor: no gradient). Whatever the
model's forward computes once for all its layers is computed again where it is needed from those two: each
decoder layer asks the model's rotary module for its cos/sin, and its attention (pipe/hf/attention.py) makes
its mask from the position ids.
"""
import inspect

import torch
import torch.nn.functional as F


def _inputs(inputs):
    """(input_ids, position_ids) of a micro-batch's inputs: the token ids alone (positions 0..s-1 in every row)
    or the pair (positions restarting at 0 start a new packed document)."""
    if torch.is_tensor(inputs):  # contiguous: DeepSpeed's own engine sends them to the next stage as they are
        return inputs, torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1).contiguous()
    input_ids, position_ids = inputs
    return input_ids, position_ids


class HFEmbedding(torch.nn.Module):
    """The model's input embedding (token ids -> hidden states); with tied embeddings also its output layer (the
    same matrix), so that one TiedLayerSpec module serves both ends and DeepSpeed ties its `weight`."""

    def __init__(self, embed_tokens, lm_head=None, softcap=None):
        super().__init__()
        self.embed_tokens, self.lm_head, self.softcap = embed_tokens, lm_head, softcap

    @property
    def weight(self):
        return self.embed_tokens.weight

    def forward(self, inputs):
        input_ids, position_ids = _inputs(inputs)
        return self.embed_tokens(input_ids), position_ids


class HFPositions(torch.nn.Module):
    """A learned position table's rows at the position ids added to the token embedding, then the base model's
    embedding dropout (GPT-2's wpe and drop); a layer of its own, so that the tied token embedding stays the
    only module both ends hold."""

    def __init__(self, positions=None, dropout=None):
        super().__init__()
        self.positions, self.dropout = positions, dropout

    def forward(self, inputs):
        hidden, position_ids = inputs
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        return (hidden if self.dropout is None else self.dropout(hidden)), position_ids


class HFTransformerLayer(torch.nn.Module):
    """One decoder layer of the model (named so that DeepSpeed's "type:transformer", the GPT's cut, finds it): its rotary cos/sin from the position ids (the model's rotary module, for
    this layer's type where the model has several), no mask (our attention makes it), no cache."""

    def __init__(self, layer, rotary, layer_type=None):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        takes_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.rotary_args = {"layer_type": layer_type} if takes_type else {}

    def forward(self, inputs):
        hidden, position_ids = inputs
        kwargs = {}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids, **self.rotary_args)
        out = self.layer(hidden, attention_mask=None, position_ids=position_ids, use_cache=False, **kwargs)
        return (out[0] if isinstance(out, tuple) else out), position_ids


class HFNorm(torch.nn.Module):
    """The base model's final norm; the position ids end here."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        hidden, _ = inputs
        return self.norm(hidden)


def logits(lm_head, hidden, softcap=None):
    """The output layer's logits, capped as the model caps them (config.final_logit_softcapping)."""
    out = lm_head(hidden)
    return out if not softcap else torch.tanh(out / softcap) * softcap


class HFHead(torch.nn.Module):
    """An untied output layer."""

    def __init__(self, lm_head, softcap=None):
        super().__init__()
        self.lm_head, self.softcap = lm_head, softcap

    def forward(self, hidden):
        return logits(self.lm_head, hidden, self.softcap)


def tied_head(module, hidden):
    """A TiedLayerSpec's forward_fn: the tied HFEmbedding's output layer."""
    return logits(module.lm_head, hidden, module.softcap)


def causal_lm_loss(logits, labels):
    """Mean cross entropy of the next-token labels (already shifted: labels[t] follows input_ids[t]), -100
    ignored, as transformers' ForCausalLMLoss on unshifted labels. A Seq1F1B segment's labels come as (its
    labels, the micro-batch's scored token count): its share, the segments' shares summing to the mean."""
    if isinstance(labels, tuple):
        labels, scored = labels
        total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total / scored
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
