"""The GPT as pipeline layer specs, and the same layers as one single-process module.

Global layer indices (they name DeepSpeed's layer checkpoint files):
0 embedding, 1..L transformer layers, L+1 final norm, L+2 LM head: tied to 0 (its
weight is the embedding's, kept equal by DeepSpeed's tied-weight all-reduce) or,
untied, a layer with its own weight.
"""
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from megatron_ds.gpt_config import GPTConfig
from .documents import Packing, opened
from .layers import Embedding, FinalNorm, LMHead, TiedLMHead, TransformerLayer, lm_head

TIED_KEY = "embed"
TIED_ATTR = "wte.weight"


def gpt_layer_specs(config: GPTConfig):
    L = config.num_layers
    layers = [LayerSpec(TransformerLayer, config, i) for i in range(1, L + 1)] + [LayerSpec(FinalNorm, config, L + 1)]
    if not config.tied_head:
        return [LayerSpec(Embedding, config, 0), *layers, LayerSpec(LMHead, config, L + 2)]
    return ([TiedLayerSpec(TIED_KEY, Embedding, config, 0, tied_weight_attr=TIED_ATTR)] + layers
            + [TiedLayerSpec(TIED_KEY, TiedLMHead, config, 0, forward_fn=lm_head, tied_weight_attr=TIED_ATTR)])


def position_ids_like(tokens, offset: int = 0):
    return torch.arange(offset, offset + tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


class GPTModel(nn.Module):
    """The single-process reference: the pipeline layers chained in one module."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config, 0)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(1, config.num_layers + 1))
        self.final_norm = FinalNorm(config, config.num_layers + 1)
        self.lm_head = None if config.tied_head else LMHead(config, config.num_layers + 2)
        self.packing = Packing.of(config)  # packed documents: positions and attention by document

    def forward(self, tokens, position_ids=None):
        """position_ids feed learned absolute embeddings; rope and alibi use the token's index, or, with
        packed documents, RoPE the position_ids (by default positions as the packing restarts them)."""
        if position_ids is None:
            position_ids = self.packing.positions(tokens) if self.packing else position_ids_like(tokens)
        documents = self.packing.documents(tokens, position_ids) if self.packing else None
        with opened(documents):
            x = self.embedding((tokens, position_ids))
            for layer in self.layers:
                x = layer(x)
        x = self.final_norm(x)
        out = lm_head(self.embedding, x) if self.lm_head is None else self.lm_head(x)
        if isinstance(out, tuple):  # a chunked head (--loss-chunk-size) leaves its GEMM to the pipeline's loss
            hidden, weight = out
            return torch.nn.functional.linear(hidden, weight)
        return out

    def pipeline_layers(self):
        """Modules by global layer index (a tied head is the embedding module again)."""
        return [self.embedding, *self.layers, self.final_norm, self.lm_head or self.embedding]

    def named_parameters_by_layer(self):
        """{(global layer index, local name): parameter}; a tied head's weight is under index 0 only."""
        layers = self.pipeline_layers()
        out = {}
        for idx, module in enumerate(layers if self.lm_head is not None else layers[:-1]):
            for name, p in module.named_parameters():
                out[(idx, name)] = p
        return out

    @torch.no_grad()
    def load_parameters_by_layer(self, tensors: dict):
        """Copy {(global layer index, local name): tensor} (e.g. from hf.from_hf_state_dict) into the model."""
        params = self.named_parameters_by_layer()
        if tensors.keys() != params.keys():
            raise ValueError(f"parameters missing: {sorted(params.keys() - tensors.keys())}, "
                             f"unexpected: {sorted(tensors.keys() - params.keys())}")
        for key, p in params.items():
            p.copy_(tensors[key])
