"""Softmax attention probabilities chunk by chunk of queries (for the statistics pass).

Never builds a T x T matrix for the whole batch: each step holds [B, Hq, chunk, Tk] only.
Masking is the same as the model's attention (`ops.masks.attention_mask`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .masks import attention_mask


def iter_attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    chunk_size: int = 256,
    q_offset: int = 0,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, probs) with probs [B, Hq, c, Tk] in fp32 for queries start..start+c-1.

    q [B, Hq, Tq, D] and k [B, Hkv, Tk, D] as returned by `Attention.project_qkv` (after q/k norm
    and RoPE); Hq must be a multiple of Hkv (GQA: query head h reads kv head h // (Hq // Hkv)).
    doc_ids [B, Tk] packs documents (queries and keys share them when Tq == Tk). q_offset is the
    absolute index of the first query (keys start at 0), for queries that follow a prefix.
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hkv})")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    group = hq // hkv
    kf = k.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, Tk]
    k_index = torch.arange(tk, device=q.device)
    for start in range(0, tq, chunk_size):
        stop = min(start + chunk_size, tq)
        qc = q[:, :, start:stop].float().reshape(b, hkv, group, stop - start, d)
        scores = (qc @ kf).reshape(b, hq, stop - start, tk) * scale
        q_index = torch.arange(q_offset + start, q_offset + stop, device=q.device)
        doc_q = doc_ids[:, q_offset + start : q_offset + stop] if doc_ids is not None else None
        mask = attention_mask(q_index, k_index, sliding_window, doc_q, doc_ids)
        yield start, scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
