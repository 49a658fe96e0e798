"""Sampling from a causal LM: greedy, or temperature with top-k and/or top-p (nucleus) filtering.

Each new token runs the model over the whole context (no K/V cache): the
reference model is for checking and small models, not for serving.
"""
import torch


def filter_logits(logits, top_k=0, top_p=0.0):
    """Logits outside the top k, or outside the smallest set holding probability top_p, become -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative > top_p
        drop[1:] = drop[:-1].clone()  # keep the token that crosses top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def next_token(logits, greedy=False, temperature=1.0, top_k=0, top_p=0.0, generator=None):
    if greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model, context, max_new_tokens, max_length, eod=None, **sampling):
    """New tokens after `context` (a list of ids): at most max_new_tokens, the whole sequence at most
    max_length; stops after `eod`. `sampling`: next_token's options."""
    tokens = list(context)
    new = []
    while len(new) < max_new_tokens and len(tokens) < max_length:
        logits = model(torch.tensor([tokens]))[0, -1].float()
        token = next_token(logits, **sampling)
        tokens.append(token)
        new.append(token)
        if token == eod:
            break
    return new
