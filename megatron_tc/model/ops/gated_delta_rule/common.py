"""Helpers shared by the gated delta rule kernels (input checks, L2 norm, document resets)."""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (flash-linear-attention's definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def reset_mask(doc_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Bool [B, T]: True where a new document starts at t > 0 (the state is zeroed before t).

    Position 0 is never a reset: the state before it is `initial_state`.
    """
    if doc_ids is None:
        return None
    if doc_ids.shape != (batch, seq_len):
        raise ValueError(f"doc_ids must have shape [B, T] = {[batch, seq_len]}, got {list(doc_ids.shape)}")
    resets = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    resets[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return resets


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    """Raise a ValueError that names the offending tensor when shapes do not follow fla's layout."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, Dk] with equal shapes, got {list(q.shape)} and {list(k.shape)}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v must be [B, T, H, Dv] = [{b}, {t}, {h}, Dv], got {list(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, h):
            raise ValueError(f"{name} must be [B, T, H] = {[b, t, h]}, got {list(x.shape)}")
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, Dk, Dv] = {[b, h, dk, v.shape[-1]]}, got {list(initial_state.shape)}"
        )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64 (reference checks); everything else runs in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
