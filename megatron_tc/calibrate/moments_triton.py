"""Fused Triton kernel for the per-query-row attention statistics of sweep 1 (docs/method.md s.3).

One program per (query block, batch x query head) walks the key blocks its rows can see once,
flash-attention style, and keeps per row (fp32): the running max m of the visible non-sink logits,
z = sum e^(s-m), sum e^(s-m) (s-m), sum e^(s-m) dist, the un-normalised P@V accumulator (all
rescaled when m grows), and sum (s - mean)^2 over all visible logits. The mean is known before the
walk: by linearity it is q . (the mean visible key), from a running mean of the keys made outside
(so one pass, and no E[s^2] - E[s]^2 cancellation). The document's first token (the "sink") is kept
out of the online softmax; its logit, and the logit on the query's own key, are computed on their
own. Key blocks every row of the program sees whole, none of them a sink (the causal interior),
run without masks. The rows are closed in the same program (`_close_rows`: the per-row formulas of
`moments.close_rows`, the PyTorch reference, which stays the CPU path and the fallback), so only
the closed statistics and the attention output leave it.

Visibility needs no doc ids: documents are contiguous runs, so key j is visible to query i iff
lo[i] <= j <= i with lo = max(sink index, i - window + 1) (what `attention_sums` computes).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .moments import CLOSED_ROW_KEYS, NEG

NEG_C = tl.constexpr(NEG)  # a jit function reads only constexpr globals


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST: bf16/fp16 operands in fp32 (the interpreter's numpy
    dot has no bf16), exact products either way."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _key_block(
    q, center, offs_m, lo, sink, row_ok, offs_d, d_ok, k_base, v_base, skt, svt, scale, T, start_n,
    m, z, ent, dsum, m2, acc,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HI_LO: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One block of keys into a block of rows' running state. MASKED: some key of the block is
    hidden from (or is the sink of) some row; else every key is visible to every row and none is a
    sink (the causal interior: no masks built)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < T
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        kv_mask = d_ok[None, :]
    k = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
    if MASKED:
        vis = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= offs_m[:, None]) & row_ok[:, None] & n_ok[None, :]
        nonsink = vis & (offs_n[None, :] != sink[:, None])
        dev = tl.where(vis, s - center[:, None], 0.0)
        m_new = tl.maximum(m, tl.max(tl.where(nonsink, s, NEG_C), axis=1))
        s0 = tl.where(nonsink, s - m_new[:, None], 0.0)
        p = tl.where(nonsink, tl.exp(s0), 0.0)
    else:
        dev = s - center[:, None]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        s0 = s - m_new[:, None]
        p = tl.exp(s0)
    # logit variance over every visible key (sink included), about the rows' exact mean logit
    m2 += tl.sum(dev * dev, axis=1)
    # online softmax of the non-sink keys
    alpha = tl.exp(m - m_new)
    dist = (offs_m[:, None] - offs_n[None, :]).to(tl.float32)
    ent = alpha * (ent + (m - m_new) * z) + tl.sum(p * s0, axis=1)
    z = alpha * z + tl.sum(p, axis=1)
    dsum = alpha * dsum + tl.sum(p * dist, axis=1)
    v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
    if HI_LO:  # bf16/fp16 values: p split in two halves keeps ~16 bits of p on tensor cores
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        pv = _dot(p_hi, v, False, UPCAST) + _dot(p_lo, v, False, UPCAST)
    else:
        pv = _dot(p, v, True, UPCAST)
    acc = acc * alpha[:, None] + pv
    return m_new, z, ent, dsum, m2, acc


@triton.jit
def _rows_kernel(
    Q, K, V, KBAR, VBAR, LO, SINK,
    OUT_ROWS, OUT_Y,
    scale, T, H, GROUP, D, PLANE,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbb, sbh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HI_LO: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: B*H*T*D passes 2^31 at long context
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    rd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=rd_mask, other=0.0)
    lo = tl.load(LO + b * T + offs_m, mask=row_ok, other=0).to(tl.int32)
    sink = tl.load(SINK + b * T + offs_m, mask=row_ok, other=0).to(tl.int32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    # the sink's logit, apart from the online softmax (NEG_C when the window hides it)
    k_sink = tl.load(k_base + sink[:, None] * skt + offs_d[None, :], mask=rd_mask, other=0.0)
    s_sink = tl.sum(q.to(tl.float32) * k_sink.to(tl.float32), axis=1) * scale
    s_sink = tl.where(sink >= lo, s_sink, NEG_C)
    k_self = tl.load(k_base + offs_m[:, None] * skt + offs_d[None, :], mask=rd_mask, other=0.0)
    s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1) * scale  # the row's own key
    # each row's mean logit over its visible keys is q . (their mean key) by linearity: the
    # variance is summed about it in one pass (no cancellation, no per-block merge)
    kbar = tl.load(KBAR + b * sbb + hk * sbh + offs_m[:, None] * D + offs_d[None, :], mask=rd_mask, other=0.0)
    center = tl.sum(q.to(tl.float32) * kbar, axis=1) * scale

    m = tl.full([BLOCK_M], NEG_C, tl.float32)
    z = tl.zeros([BLOCK_M], tl.float32)
    ent = tl.zeros([BLOCK_M], tl.float32)  # sum e^(s-m) (s-m)
    dsum = tl.zeros([BLOCK_M], tl.float32)  # sum e^(s-m) dist
    m2 = tl.zeros([BLOCK_M], tl.float32)  # sum (s - mean)^2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # key blocks [k_start, i0) and [i1, k_end) need masks; [i0, i1) is the interior every row
    # sees whole with no sink in it (most of a causal row's keys)
    lo_min = tl.min(tl.where(row_ok, lo, T), axis=0)
    k_start = (lo_min // BLOCK_N) * BLOCK_N
    k_end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T)
    first_clear = tl.maximum(tl.max(tl.where(row_ok, lo, 0), axis=0), tl.max(tl.where(row_ok, sink, 0), axis=0) + 1)
    i0 = tl.minimum(tl.cdiv(first_clear, BLOCK_N) * BLOCK_N, k_end)
    i1 = tl.maximum(i0, tl.minimum(pid_m * BLOCK_M, k_end))  # BLOCK_M % BLOCK_N == 0
    for start_n in range(k_start, i0, BLOCK_N):
        m, z, ent, dsum, m2, acc = _key_block(
            q, center, offs_m, lo, sink, row_ok, offs_d, d_ok, k_base, v_base, skt, svt, scale, T, start_n,
            m, z, ent, dsum, m2, acc, BLOCK_N, True, HI_LO, IEEE, UPCAST)
    for start_n in range(i0, i1, BLOCK_N):
        m, z, ent, dsum, m2, acc = _key_block(
            q, center, offs_m, lo, sink, row_ok, offs_d, d_ok, k_base, v_base, skt, svt, scale, T, start_n,
            m, z, ent, dsum, m2, acc, BLOCK_N, False, HI_LO, IEEE, UPCAST)
    for start_n in range(i1, k_end, BLOCK_N):
        m, z, ent, dsum, m2, acc = _key_block(
            q, center, offs_m, lo, sink, row_ok, offs_d, d_ok, k_base, v_base, skt, svt, scale, T, start_n,
            m, z, ent, dsum, m2, acc, BLOCK_N, True, HI_LO, IEEE, UPCAST)

    cnt = (offs_m - lo + 1).to(tl.float32)  # visible keys lo..i
    row = pid_bh.to(tl.int64) * T + offs_m
    v_sink = tl.load(v_base + sink[:, None] * svt + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
    vbar = tl.load(VBAR + b * sbb + hk * sbh + offs_m[:, None] * D + offs_d[None, :], mask=rd_mask, other=0.0)
    _close_rows(OUT_ROWS + row, PLANE, OUT_Y + row[:, None] * D + offs_d[None, :], row_ok, rd_mask,
                m, z, ent, dsum, cnt, m2 / tl.maximum(cnt, 1.0), s_sink, s_self, acc, v_sink, vbar,
                (offs_m - sink).to(tl.float32))


@triton.jit
def _xlogx(x):
    return tl.where(x > 0, x * tl.log(tl.where(x > 0, x, 1.0)), 0.0)


@triton.jit
def _close_rows(
    base, PLANE, y_ptrs, row_ok, out_mask, m, z, ent_sum, dist_sum, n, var, s_sink, s_self, acc, v_sink, vbar,
    d_sink,
):
    """`moments.close_rows` per row, in the kernel: each CLOSED_ROW_KEYS statistic of the rows
    (one plane each from `base`) and their attention output y (at `y_ptrs`), from the walk's
    running state (acc: the un-normalised sink-free output)."""
    m = tl.where(m > NEG_C / 2, m, s_sink)
    l_sink = s_sink - m
    ok = z > 0
    z_safe = tl.where(ok, z, 1.0)
    log_rest = tl.where(ok, tl.log(z_safe), float("-inf"))
    top = tl.maximum(log_rest, l_sink)
    log_z = top + tl.log(tl.exp(log_rest - top) + tl.exp(l_sink - top))
    p_sink = tl.exp(l_sink - log_z)
    z_ns = tl.exp(log_rest - log_z)
    dist_ns = dist_sum / z_safe
    ent_ns = tl.log(z_safe) - ent_sum / z_safe
    y = (z_ns / z_safe)[:, None] * acc + p_sink[:, None] * v_sink
    err = tl.where(out_mask, y - vbar, 0.0)
    zero_err = tl.sum(err * err, axis=1)
    ent = z_ns * ent_ns - _xlogx(z_ns) - _xlogx(p_sink)
    n_ns = n - (s_sink > NEG_C / 2).to(tl.float32)
    has2 = n >= 2
    tl.store(base, z_ns * dist_ns + p_sink * d_sink, mask=row_ok)
    tl.store(base + PLANE, ent, mask=row_ok)
    tl.store(base + 2 * PLANE, p_sink, mask=row_ok)
    tl.store(base + 3 * PLANE, tl.maximum(var, 0.0), mask=row_ok)
    tl.store(base + 4 * PLANE, zero_err, mask=row_ok)
    tl.store(base + 5 * PLANE, tl.where(has2 & ok, dist_ns, 0.0), mask=row_ok)
    tl.store(base + 6 * PLANE, tl.where(has2, 1 - ent / tl.log(tl.maximum(n, 2.0)), 0.0), mask=row_ok)
    conc_ns = 1 - ent_ns / tl.log(tl.maximum(n_ns, 2.0))
    tl.store(base + 7 * PLANE, tl.where((n_ns >= 2) & ok, conc_ns, 0.0), mask=row_ok)
    tl.store(base + 8 * PLANE, tl.exp(s_self - m - log_z), mask=row_ok)
    tl.store(y_ptrs, y, mask=out_mask)


def attention_closed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lo: torch.Tensor, sink: torch.Tensor,
    kbar: torch.Tensor, vbar: torch.Tensor, block_m: int = 64, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 3,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-row statistics of softmax attention, one pass over the visible keys, closed per row in
    the same kernel (`moments.close_rows`' per-row formulas).

    q [B, Hq, T, D], k/v [B, Hkv, T, D] (fp32, bf16 or fp16, any strides with unit last stride);
    lo [B, T] first visible key of each query, sink [B, T] its document's first token (the sink is
    visible iff sink >= lo); kbar/vbar [B, Hkv, T, D] the mean key and value over lo..t of each
    query (`moments.running_mean_values`). Returns ({key: [B, Hq, T] fp32} for CLOSED_ROW_KEYS,
    y [B, Hq, T, D] fp32 the attention output).
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key heads ({hkv})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    kbar, vbar = kbar.float(), vbar.float()
    # one stride pair serves both means: [B, Hkv] planes of contiguous [T, D] rows
    if any(x.stride(3) != 1 or x.stride(2) != d or x.stride()[:2] != kbar.stride()[:2] for x in (kbar, vbar)):
        kbar, vbar = kbar.contiguous(), vbar.contiguous()
    rows = torch.empty(len(CLOSED_ROW_KEYS), b, h, t, dtype=torch.float32, device=q.device)
    y = torch.empty(b, h, t, d, dtype=torch.float32, device=q.device)
    lo32 = lo.to(torch.int32).contiguous()
    sink32 = sink.to(torch.int32).contiguous()
    low = q.dtype in (torch.bfloat16, torch.float16)
    dtype = q.dtype if low else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    block_d = max(16, triton.next_power_of_2(d))
    # the fastest launch configuration of `tools/bench/stats.py --kernel-configs` on an H200 at
    # head_dim 64 and 128 (docs/benchmarks.md)
    block_n = block_n or 64
    num_warps = num_warps or 4
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    grid = (triton.cdiv(t, block_m), b * h)
    _rows_kernel[grid](
        q, k, v, kbar, vbar, lo32, sink32, rows, y, float(scale), t, h, h // hkv, d, b * h * t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kbar.stride(0), kbar.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HI_LO=low, IEEE=not low,
        UPCAST=low and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    return dict(zip(CLOSED_ROW_KEYS, rows.unbind(0))), y
