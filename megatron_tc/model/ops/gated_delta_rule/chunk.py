"""Pure-PyTorch chunked gated delta rule (the CPU training path).

Math, per head and per chunk of C positions (state S [Dk, Dv] entering the chunk; G_i = sum of g
over the chunk up to i; all masks also require i and j to be in the same document)::

    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)          for j < i        (strictly lower)
    T       = (I + A)^-1                                  (UT transform, one triangular solve)
    W       = T (beta * exp(G) * carry * k)   [C, Dk]     (WY form of the state's influence)
    U       = T (beta * v)                    [C, Dv]
    V'      = U - W S                                     (pseudo-values after the delta correction)
    O       = (exp(G) * carry * q) S + (Q K^T . exp(G_i - G_j))_{j <= i} V'
    S_next  = exp(G_C) carry_C S + sum_j exp(G_C - G_j) k_j V'_j^T

`carry_i` is 1 while position i still belongs to the document that entered the chunk (no reset
at or before i inside the chunk), so a document start zeroes the state exactly as the
recurrence does. Sequence lengths that are not a multiple of C are padded with zeros (k = 0,
g = 0, beta = 0 leave the state unchanged), so the final state is the one after the last token.
The loop runs over T / C chunks only; everything inside a chunk is a batched matmul, and
autograd differentiates it (including `torch.linalg.solve_triangular`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_inputs, compute_dtype, l2norm, reset_mask


def _to_chunks(x: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """[B, T, H, (D)] -> [B, H, N, C, (D)] with zero padding at the end of T."""
    x = x.transpose(1, 2)
    if pad:
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
    b, h, t = x.shape[:3]
    return x.reshape(b, h, t // chunk_size, chunk_size, *x.shape[3:])


def _document_masks(
    resets: torch.Tensor | None, pad: int, chunk_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """carry [B,1,N,C] (still in the incoming document) and same [B,1,N,C,C] (same document)."""
    if resets is None:
        return None, None
    r = F.pad(resets, (0, pad)) if pad else resets
    b, t = r.shape
    segment = r.reshape(b, t // chunk_size, chunk_size).long().cumsum(-1)  # 0: incoming document
    carry = (segment == 0).unsqueeze(1)
    same = (segment[..., :, None] == segment[..., None, :]).unsqueeze(1)
    return carry, same


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked form of the recurrence. Shapes as `gated_delta_rule`."""
    check_inputs(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v.dtype
    dt = compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    # exp(-1e4) is exactly 0 in fp32 and fp64, so no decay factor changes; the floor only keeps -inf
    # (exp(A_log) overflowed) out of the cumulative sums below, where -inf - -inf would be NaN
    g = g.clamp_min(-1e4)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    q = q * (dk**-0.5 if scale is None else scale)
    pad = (-t) % c
    carry, same = _document_masks(reset_mask(doc_ids, b, t, q.device), pad, c)
    q, k, v, g, beta = (_to_chunks(x, pad, c) for x in (q, k, v, g, beta))
    n = q.shape[2]

    cum_g = g.cumsum(-1)  # [B,H,N,C]
    keep = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if same is not None:
        keep = keep & same
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~keep, float("-inf")).exp()
    a = (k @ k.transpose(-1, -2) * decay * beta[..., :, None]).tril(-1)
    eye = torch.eye(c, dtype=dt, device=q.device)
    k_in = k * (beta * cum_g.exp())[..., None]
    q_in = q * cum_g.exp()[..., None]
    if carry is not None:
        k_in = k_in * carry[..., None]
        q_in = q_in * carry[..., None]
    solved = torch.linalg.solve_triangular(eye + a, torch.cat([k_in, v * beta[..., None]], -1), upper=False, unitriangular=True)
    w, u = solved.split([dk, dv], dim=-1)
    qk = q @ k.transpose(-1, -2) * decay
    k_out = k * decay[..., -1, :, None]  # exp(G_C - G_j), same document as the chunk's last token
    state_decay = cum_g[..., -1].exp()  # [B,H,N]
    if carry is not None:
        state_decay = state_decay * carry[..., -1]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + qk[:, :, i] @ v_new)
        state = state * state_decay[:, :, i, None, None] + k_out[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), (state if output_final_state else None)
