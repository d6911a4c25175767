"""Fused Triton kernel for sweep 2's per-head sums of the reads (docs/method.md section 3, "Readout sums").

Per head h, over tokens and channels: u.y, r.y, y.y, u.u and r.r, for the read through o_norm u,
the raw read r and the teacher's head output y (the keys uy, ry, yy, uu, rr of every candidate
without an output gate). The PyTorch path (`readout.layers_readout_sums`) concatenates the reads,
writes their products with y and their squares, and reads them back for the sums: about 20 passes
over a [tokens, heads, D] fp32 tensor. Here one program per (block of tokens, head) loads its
block of u, r and y once; the products are fp32 (as the PyTorch path makes them) summed in fp64.
The per-block partial sums [blocks, heads, 5] are added up by torch in a fixed order, so a run
gives the same sums every time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 64
READ_SUM_KEYS = ("uy", "ry", "yy", "uu", "rr")


@triton.jit
def _read_sums_kernel(
    U, R, Y, PARTIAL,
    N, HEADS, D,
    sun, suh, srn, srh, syn, syh,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_n < N)[:, None] & (offs_d < D)[None, :]  # padding loads 0: adds nothing
    u = tl.load(U + offs_n[:, None] * sun + h * suh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + offs_n[:, None] * srn + h * srh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + offs_n[:, None] * syn + h * syh + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    out = PARTIAL + (pid_n * HEADS + h).to(tl.int64) * 5
    tl.store(out, tl.sum(tl.sum((u * y).to(tl.float64), axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum((r * y).to(tl.float64), axis=1), axis=0))
    tl.store(out + 2, tl.sum(tl.sum((y * y).to(tl.float64), axis=1), axis=0))
    tl.store(out + 3, tl.sum(tl.sum((u * u).to(tl.float64), axis=1), axis=0))
    tl.store(out + 4, tl.sum(tl.sum((r * r).to(tl.float64), axis=1), axis=0))


def read_sums(u: torch.Tensor, r: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[heads, 5] fp64: per head the sums over tokens and channels of u*y, r*y, y*y, u*u, r*r
    (READ_SUM_KEYS) for u, r, y [..., heads, D] of one shape (fp32 or 16-bit, on one device)."""
    if not (u.shape == r.shape == y.shape) or u.dim() < 2:
        raise ValueError(f"read_sums needs u, r, y of one shape [..., heads, D], got {tuple(u.shape)}, "
                         f"{tuple(r.shape)}, {tuple(y.shape)}")
    heads, d = u.shape[-2:]
    u, r, y = (x.reshape(-1, heads, d) for x in (u, r, y))  # a view where the layout allows
    u, r, y = (x if x.stride(2) == 1 else x.contiguous() for x in (u, r, y))
    n = u.shape[0]
    blocks = max(1, triton.cdiv(n, BLOCK_TOKENS))
    partial = torch.empty(blocks, heads, 5, dtype=torch.float64, device=u.device)
    _read_sums_kernel[(blocks, heads)](
        u, r, y, partial, n, heads, d, u.stride(0), u.stride(1), r.stride(0), r.stride(1), y.stride(0), y.stride(1),
        BLOCK_N=BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(d),
    )
    return partial.sum(0)
