"""GPT-2 as pipeline layer specs, and the same layers as one single-process module.

Global layer indices (they name DeepSpeed's layer checkpoint files):
0 embedding, 1..L transformer layers, L+1 final norm, L+2 LM head (tied to 0).
"""
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from .config import GPTConfig
from .layers import Embedding, FinalNorm, TiedLMHead, TransformerLayer, lm_head

TIED_KEY = "embed"
TIED_ATTR = "wte.weight"


def gpt_layer_specs(config: GPTConfig):
    L = config.num_layers
    return ([TiedLayerSpec(TIED_KEY, Embedding, config, 0, tied_weight_attr=TIED_ATTR)]
            + [LayerSpec(TransformerLayer, config, i) for i in range(1, L + 1)]
            + [LayerSpec(FinalNorm, config, L + 1),
               TiedLayerSpec(TIED_KEY, TiedLMHead, config, 0, forward_fn=lm_head, tied_weight_attr=TIED_ATTR)])


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

    def forward(self, tokens, position_ids=None):
        if position_ids is None:
            position_ids = position_ids_like(tokens)
        x = self.embedding((tokens, position_ids))
        for layer in self.layers:
            x = layer(x)
        return lm_head(self.embedding, self.final_norm(x))

    def pipeline_layers(self):
        """Modules by global layer index (the head shares the embedding module)."""
        return [self.embedding, *self.layers, self.final_norm, self.embedding]

    def named_parameters_by_layer(self):
        """{(global layer index, local name): parameter}, the head's tied weight under index 0."""
        out = {}
        for idx, module in enumerate(self.pipeline_layers()[:-1]):
            for name, p in module.named_parameters():
                out[(idx, name)] = p
        return out
