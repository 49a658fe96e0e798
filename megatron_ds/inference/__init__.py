"""Text generation and perplexity with the single-process reference GPTModel (no training, no process group)."""
