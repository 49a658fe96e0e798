from megatron_ds.gpt_config import GPTConfig
from .gpt import GPTModel, gpt_layer_specs, position_ids_like
from .layers import Embedding, FinalNorm, LMHead, Norm, TiedLMHead, TransformerLayer, gpt_loss, lm_head
from .linear import Linear, WeightGradStore
