"""Autoregressive generation with `HybridCache`: one prefill, then one token per step.

Attention layers keep KV (the last window on sliding layers); GDN layers keep a constant-size
recurrent state, so their per-token cost does not grow with the context.
"""
from __future__ import annotations

import torch

from .cache import HybridCache
from .transformer import HybridLM


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; temperature 0 means greedy."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: HybridLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """input_ids [B, T] -> [B, T + n] with n <= max_new_tokens new tokens.

    Greedy unless do_sample. Rows that produced eos_token_id keep emitting it; generation stops
    early when every row has. Works for teachers (all 'A') and hybrids alike.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {list(input_ids.shape)}")
    cache = HybridCache(model.arch, max_length=input_ids.shape[1] + max_new_tokens)
    logits = model(input_ids, cache=cache)[:, -1]
    out = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature if do_sample else 0.0, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done = done | (token == eos_token_id)
        out.append(token[:, None])
        if (eos_token_id is not None and bool(done.all())) or step + 1 == max_new_tokens:
            break
        logits = model(token[:, None], cache=cache)[:, -1]
    return torch.cat(out, dim=1)
