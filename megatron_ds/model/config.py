"""GPT hyper-parameters, named as Megatron's flags."""
from dataclasses import dataclass


@dataclass
class GPTConfig:
    vocab_size: int  # already padded (Megatron's padded_vocab_size)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    ffn_hidden_size: int = 0  # 0 means 4 * hidden_size
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    seed: int = 1234  # every layer draws its initial weights from seed + its global layer index

    def __post_init__(self):
        if not self.ffn_hidden_size:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size ({self.hidden_size}) must be divisible by "
                             f"--num-attention-heads ({self.num_attention_heads})")

    @property
    def num_pipeline_layers(self):
        """Embedding, the transformer layers, the final norm and the tied LM head."""
        return self.num_layers + 3
