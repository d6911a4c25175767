"""Per-layer Taylor statistics of one softmax attention layer, as fp64 sums over query tokens.

Pure math on tensors (no model, no process groups): `attention_sums` takes what the teacher's
attention computed for one batch and returns sums whose division by the token counts gives the
statistics of docs/method.md section 3. Attention probabilities arrive one chunk of queries at a
time from `model.ops.iter_attention_probs`, so memory is B*H*chunk*T, never B*H*T*T.
"""
from __future__ import annotations

import torch

from megatron_tc.model.ops import attention_mask, iter_attention_probs, positions_from_doc_ids

F64 = torch.float64

# Which count divides each per-head sum (docs/method.md section 3).
DENOMINATOR = {
    "dist": "count", "entropy": "count", "sink": "count", "logit_var": "count",
    "out_energy": "count", "out_energy_o": "count", "zero_order_err": "count",
    "dist_nosink": "count2", "conc": "count2", "conc_nosink": "count3",
}
HEAD_KEYS = tuple(DENOMINATOR) + ("y_sum", "y_sq")
KV_HEAD_KEYS = ("k_sum", "k_sq", "v_sum", "v_sq")
LAYER_KEYS = ("count", "count2", "count3", "x_sum", "x_energy", "resid_energy", "Y_energy")


def empty_layer_sums(
    num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Zero sums of one layer with the shapes `attention_sums` adds into (fp64, on `device`:
    the teacher's, so per-batch results are added where they are computed)."""
    h, kv, d = num_heads, num_kv_heads, head_dim
    zeros = lambda *shape: torch.zeros(*shape, dtype=F64, device=device)  # noqa: E731
    out = {key: zeros(h) for key in DENOMINATOR}
    out.update(y_sum=zeros(h, d), y_sq=zeros(h, d, d), k_sum=zeros(kv, d), k_sq=zeros(kv, d, d))
    out.update(v_sum=zeros(kv, d), v_sq=zeros(kv, d, d), x_sum=zeros(hidden))
    out.update({key: zeros(()) for key in ("count", "count2", "count3", "x_energy", "resid_energy", "Y_energy")})
    return out


def _sink_index(doc_ids: torch.Tensor | None, b: int, t: int, device: torch.device) -> torch.Tensor:
    """[B, T] sequence index of the first token of each token's document."""
    index = torch.arange(t, device=device).expand(b, t)
    if doc_ids is None:
        return torch.zeros_like(index)
    return index - positions_from_doc_ids(doc_ids)


def _chunk_head_sums(
    p: torch.Tensor, mask: torch.Tensor, dist: torch.Tensor, sink: torch.Tensor, v: torch.Tensor,
    vbar: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sums over the queries of one chunk.

    p [B, H, c, T] probabilities (0 where masked), mask [B, 1, c, T] bool, dist [c, T] query-key
    distance, sink [B, c] key index of each query's sink, v [B, H, T, D] (expanded to query heads),
    vbar [B, H, c, D] mean visible value of each query (the zero-order term).
    Returns (per-head sums [H] in fp64, y [B, H, c, D] fp32 head outputs).
    """
    n = mask.sum(-1, dtype=torch.float32)  # [B, 1, c] visible keys
    h = p.shape[1]
    sink_at = sink[:, None, :, None].expand(-1, h, -1, 1)
    plogp = torch.special.xlogy(p, p)
    ent = -plogp.sum(-1)  # [B, H, c]
    pd = (p * dist).sum(-1)
    p_sink = p.gather(-1, sink_at).squeeze(-1)
    d_sink = dist.expand(p.shape[0], -1, -1).gather(-1, sink[:, :, None]).squeeze(-1)[:, None]  # [B, 1, c]
    has2 = n >= 2
    # attention renormalised over the non-sink keys: Z = sum_{j != s} p_j, summed (not 1 - p_s,
    # which cancels when the sink holds nearly all the mass)
    not_sink = torch.ones_like(p[:, :1]).scatter_(-1, sink[:, None, :, None], 0.0)
    z_ns = (p * not_sink).sum(-1)
    ok_ns = has2 & (z_ns > 0)
    z_safe = torch.where(ok_ns, z_ns, torch.ones_like(z_ns))
    dist_ns = (pd - p_sink * d_sink) / z_safe
    ent_ns = (ent + plogp.gather(-1, sink_at).squeeze(-1)) / z_safe + torch.log(z_safe)
    sink_seen = mask.gather(-1, sink[:, None, :, None]).squeeze(-1)  # False when a window hides it
    n_ns = n - sink_seen.float()
    has_ns2 = n_ns >= 2
    log_n = torch.log(n.clamp_min(2))
    log_n1 = torch.log(n_ns.clamp_min(2))
    # logit variance over visible keys: log p differs from the logits by a per-row constant
    logp = (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) * mask).to(F64)  # fp64: E[l^2] - E[l]^2 cancels
    mean_lp = logp.sum(-1) / n
    var_lp = ((logp * logp).sum(-1) / n - mean_lp * mean_lp).float()
    y = p @ v  # [B, H, c, D]
    zero_err = (y - vbar).pow(2).sum(-1)

    def total(x: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        x = x.to(F64)
        if where is not None:
            x = x * where.to(F64)
        return x.sum(dim=(0, 2))

    sums = {
        "dist": total(pd), "entropy": total(ent), "sink": total(p_sink), "logit_var": total(var_lp.clamp_min(0)),
        "zero_order_err": total(zero_err),
        "dist_nosink": total(dist_ns, ok_ns), "conc": total(1 - ent / log_n, has2),
        "conc_nosink": total(1 - ent_ns / log_n1, has_ns2 & ok_ns),
    }
    return sums, y


def running_mean_values(v: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """vbar [B, H, T, D]: mean of v [B, H, T, D] over the visible keys lo[b, t]..t (fp64 cumsum)."""
    b, h, t, d = v.shape
    csum = torch.cat([v.new_zeros(b, h, 1, d, dtype=F64), v.to(F64).cumsum(dim=2)], dim=2)  # [B, H, T+1, D]
    index = torch.arange(t, device=v.device)
    upper = csum[:, :, 1:]
    lower = csum.gather(2, lo[:, None, :, None].expand(-1, h, -1, d))
    count = (index[None] - lo + 1).to(F64)[:, None, :, None]
    return ((upper - lower) / count).float()


def attention_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    o_weight: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int = 128,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-head and per-KV-head sums of one attention layer over a batch.

    q [B, Hq, T, D], k/v [B, Hkv, T, D]: what the teacher's softmax sees (after q/k norm and
    RoPE); o_weight [hidden, Hq*D] the layer's o_proj weight (its head columns); doc_ids [B, T].
    Returns (sums, y) with y [B, Hq, T, D] the per-head attention outputs (before o_proj).
    Layer-level keys (count, x_*, resid_energy, Y_energy) are added by `layer_input_sums`.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    v_exp = v.float().repeat_interleave(group, dim=1)
    o_heads = o_weight.float().view(o_weight.shape[0], hq, d)  # [hidden, H, D]
    sink_index = _sink_index(doc_ids, b, t, q.device)
    k_index = torch.arange(t, device=q.device)
    lo = sink_index if sliding_window is None else torch.maximum(sink_index, k_index[None] - sliding_window + 1)
    vbar = running_mean_values(v_exp, lo)
    sums = {key: torch.zeros(hq, dtype=F64, device=q.device) for key in DENOMINATOR}
    ys = []
    for start, p in iter_attention_probs(q, k, scale, sliding_window, doc_ids, chunk_size):
        stop = start + p.shape[2]
        q_index = torch.arange(start, stop, device=q.device)
        doc_q = doc_ids[:, start:stop] if doc_ids is not None else None
        mask = attention_mask(q_index, k_index, sliding_window, doc_q, doc_ids)
        mask = mask.expand(b, 1, -1, -1)
        dist = (q_index[:, None] - k_index[None, :]).clamp_min(0).float()
        chunk, y = _chunk_head_sums(p, mask, dist, sink_index[:, start:stop], v_exp, vbar[:, :, start:stop])
        for key, value in chunk.items():
            sums[key] += value
        ys.append(y)
    y = torch.cat(ys, dim=2)
    y64 = y.to(F64)
    sums["out_energy"] = y64.pow(2).sum(dim=(0, 2, 3))
    yo = torch.einsum("bhtd,nhd->bhtn", y, o_heads)
    sums["out_energy_o"] = yo.to(F64).pow(2).sum(dim=(0, 2, 3))
    sums["y_sum"] = y64.sum(dim=(0, 2))
    sums["y_sq"] = torch.einsum("bhtd,bhte->hde", y64, y64)
    for name, x in (("k", k), ("v", v)):
        x64 = x.to(F64)
        sums[f"{name}_sum"] = x64.sum(dim=(0, 2))
        sums[f"{name}_sq"] = torch.einsum("bhtd,bhte->hde", x64, x64)
    return sums, y


def layer_input_sums(
    x: torch.Tensor, resid: torch.Tensor, out: torch.Tensor, doc_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> dict[str, torch.Tensor]:
    """Layer-level sums: token counts, mixer input x [B, T, hidden] (after input_norm), residual
    stream `resid` entering the layer, mixer output `out` (attention after o_proj)."""
    b, t, _ = x.shape
    n, sink_seen = _visible_keys(b, t, doc_ids, sliding_window, x.device)
    return {
        "count": torch.tensor(float(b * t), dtype=F64, device=x.device),
        "count2": (n >= 2).sum().to(F64),
        "count3": ((n - sink_seen.long()) >= 2).sum().to(F64),
        "x_sum": x.to(F64).sum(dim=(0, 1)),
        "x_energy": x.to(F64).pow(2).sum(),
        "resid_energy": resid.to(F64).pow(2).sum(),
        "Y_energy": out.to(F64).pow(2).sum(),
    }


def _visible_keys(b: int, t: int, doc_ids: torch.Tensor | None, window: int | None, device):
    """([B, T] number of keys each query sees (same document, causal, sliding window),
    [B, T] bool: whether the document's first token is among them)."""
    pos = positions_from_doc_ids(doc_ids) if doc_ids is not None else torch.arange(t, device=device).expand(b, t)
    n = pos + 1
    if window is None:
        return n, torch.ones_like(n, dtype=torch.bool)
    return n.clamp(max=window), pos < window


def add_into(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    for key, value in part.items():
        total[key] += value
