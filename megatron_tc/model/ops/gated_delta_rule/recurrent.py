"""Step-by-step reference of the gated delta rule (slow, obviously correct).

Per head, with the state S in fla's layout [Dk, Dv]::

    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

(the transpose of docs/method.md's `S_t = a_t S_{t-1}(I - b_t k_t k_t^T) + b_t v_t k_t^T` with S [Dv, Dk]).
"""
from __future__ import annotations

import torch

from .common import check_inputs, compute_dtype, l2norm, reset_mask


def recurrent_gated_delta_rule(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Loop over time. Shapes as `gated_delta_rule`; returns (o [B,T,H,Dv], state [B,H,Dk,Dv] or None)."""
    check_inputs(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    dt = compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    b, t, h, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    q = q * scale
    resets = reset_mask(doc_ids, b, t, q.device)
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(t):
        if resets is not None:
            state = state * (~resets[:, i]).to(dt)[:, None, None, None]
        k_i, v_i, b_i = k[:, i], v[:, i], beta[:, i]  # [B,H,Dk], [B,H,Dv], [B,H]
        state = state * g[:, i].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k_i, state)
        delta = (v_i - predicted) * b_i[..., None]
        state = state + k_i[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    o = torch.stack(outs, dim=1).to(out_dtype)
    return o, (state if output_final_state else None)
