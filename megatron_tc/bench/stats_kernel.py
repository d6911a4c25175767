"""Sweep 1's fused kernel (`calibrate.moments_triton`) under its launch configurations, beside
flash attention (`F.scaled_dot_product_attention`, causal) over the same q/k/v: what the kernel
costs against the attention the teacher's forward ran (tools/bench/stats.py --kernel-configs)."""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from megatron_tc.config.errors import InputError
from megatron_tc.bench.common import time_fn
from megatron_tc.calibrate.moments import running_mean_values

# (block_n, num_warps, num_stages) tried per shape; block_m is 64 (rows per program)
CONFIGS = list(itertools.product((32, 64), (4, 8), (2, 3)))


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """'B,H,HKV,T,D' -> ints, with one clear error for anything else."""
    try:
        b, h, hkv, t, d = (int(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"error: --kernel-shapes entry {text!r}: write B,H,HKV,T,D (five integers)") from None
    if h % hkv:
        raise InputError(f"error: --kernel-shapes entry {text!r}: H ({h}) must be a multiple of HKV ({hkv})")
    return b, h, hkv, t, d


def kernel_rows(shape: tuple[int, int, int, int, int], device: torch.device, budget_ms: float) -> list[dict[str, Any]]:
    """One row per launch configuration of the kernel on bf16 q [B, H, T, D], k/v [B, HKV, T, D]
    (causal rows, no documents), then flash attention's row; ms from `time_fn`."""
    from megatron_tc.calibrate.moments_triton import attention_closed

    b, h, hkv, t, d = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=gen, device=device).bfloat16() for n in (h, hkv, hkv))
    lo = torch.zeros(b, t, dtype=torch.long, device=device)
    kbar, vbar = running_mean_values(torch.cat([k, v], 1), lo).chunk(2, dim=1)
    label = f"{b}x{h}x{t}x{d} (kv heads {hkv})"
    rows = []
    for block_n, warps, stages in CONFIGS:
        call = lambda: attention_closed(q, k, v, d**-0.5, lo, lo, kbar, vbar, block_n=block_n,  # noqa: E731
                                        num_warps=warps, num_stages=stages)
        try:
            ms = time_fn(call, device, budget_ms=budget_ms).ms
        except Exception as exc:  # a configuration the compiler refuses (registers, shared memory)
            rows.append({"shape": label, "impl": f"kernel n{block_n} w{warps} s{stages}", "note": repr(exc)[:120]})
            continue
        rows.append({"shape": label, "impl": f"kernel n{block_n} w{warps} s{stages}", "ms": round(ms, 3)})
    k_rep, v_rep = (x.repeat_interleave(h // hkv, 1) for x in (k, v))
    ms = time_fn(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True), device, budget_ms=budget_ms).ms
    rows.append({"shape": label, "impl": "flash attention (sdpa, causal)", "ms": round(ms, 3)})
    fastest = min((r for r in rows if "ms" in r and r["impl"].startswith("kernel")), key=lambda r: r["ms"], default=None)
    for row in rows:
        if "ms" in row:
            row["x_flash"] = round(row["ms"] / ms, 2)
        row["fastest"] = row is fastest
    return rows
