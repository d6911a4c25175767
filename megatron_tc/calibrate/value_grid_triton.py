"""Fused Triton kernel for sweep 2's value grid (docs/method.md section 3, "Readout sums").

Per value head h and scale c of `readout.VALUE_SCALE_GRID`: the sum over tokens and channels of
silu(c v)^2. The PyTorch reference (`readout.layers_value_silu_grid`) writes SiLU of every scaled
value to memory and reads it back for the square and the sum: for 81 scales about 250 bytes of
memory traffic per value. Here one program per (block of tokens, head) loads its block of v once
and loops over the scales in registers; each scale's values are fp32 (as the reference computes
them) and summed in fp64. The per-block partial sums [blocks, heads, C] are added up by torch in
a fixed order, so a run gives the same sums every time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 64


@triton.jit
def _value_grid_kernel(
    V, SCALES, PARTIAL,
    N, HEADS, D, C,
    svn, svh,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_n < N)[:, None] & (offs_d < D)[None, :]
    ptr = V + offs_n[:, None].to(tl.int64) * svn + h * svh + offs_d[None, :]
    v = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)  # padding: silu(0) = 0 adds nothing
    out = PARTIAL + (pid_n * HEADS + h).to(tl.int64) * C
    for c in range(C):
        x = tl.load(SCALES + c) * v
        y = x * tl.sigmoid(x)
        tl.store(out + c, tl.sum(tl.sum((y * y).to(tl.float64), axis=1), axis=0))


def value_grid_sums(v: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[heads, C] fp64: sum over tokens and channels of silu(c v)^2 for v [N, heads, D] (fp32,
    channels contiguous) and each of the C scales [C] (fp32, on v's device)."""
    if v.dim() != 3 or v.stride(2) != 1:
        raise ValueError(f"value_grid_sums needs v [N, heads, D] with contiguous channels, got {tuple(v.shape)} "
                         f"strides {v.stride()}")
    n, heads, d = v.shape
    count = scales.numel()
    blocks = max(1, triton.cdiv(n, BLOCK_TOKENS))
    partial = torch.empty(blocks, heads, count, dtype=torch.float64, device=v.device)
    _value_grid_kernel[(blocks, heads)](
        v, scales.reshape(-1), partial, n, heads, d, count, v.stride(0), v.stride(1),
        BLOCK_N=BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(d),
    )
    return partial.sum(0)
