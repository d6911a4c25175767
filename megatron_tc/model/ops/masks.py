"""Boolean attention masks (True = may attend) shared by SDPA and the probability generator."""
from __future__ import annotations

import torch


def attention_mask(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    sliding_window: int | None = None,
    doc_q: torch.Tensor | None = None,
    doc_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal mask [B or 1, 1, Tq, Tk].

    q_index [Tq], k_index [Tk]: absolute sequence indices (not RoPE positions).
    sliding_window W: a query sees keys with q - k < W (itself and W - 1 before it), as in
    Hugging Face's sliding-window masks. doc_q [B, Tq] / doc_k [B, Tk]: only equal ids attend.
    """
    diff = q_index[:, None] - k_index[None, :]
    allowed = diff >= 0
    if sliding_window is not None:
        allowed = allowed & (diff < sliding_window)
    allowed = allowed[None, None]
    if doc_q is not None:
        if doc_k is None:
            raise ValueError("doc_k is required together with doc_q")
        allowed = allowed & (doc_q[:, None, :, None] == doc_k[:, None, None, :])
    return allowed


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions [B, T] that restart at 0 at every document start in doc_ids [B, T]."""
    b, t = doc_ids.shape
    index = torch.arange(t, device=doc_ids.device).expand(b, t)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index
