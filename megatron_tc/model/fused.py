"""Small element-wise blocks of the model, fused by torch.compile while training on CUDA.

Why: the stage-2 profile (docs/benchmarks.md) spends most of the GPU time outside the
matmuls, in chains of element-wise kernels (RMSNorm's fp32 passes, the GDN gates, the output
gate), each a full read and write of its tensor. Each function below is the eager formula of its
block, op for op; `fused(name, fn)` returns torch.compile(fn) (one forward and one backward
kernel per block, same arithmetic in fp32 registers instead of memory) for tensors on CUDA (the
student's forward/backward and the teacher's forward), and fn itself otherwise: on CPU, while a
CUDA graph is being captured (StaticDecoder) and with MEGATRON_TC_COMPILE=0 the model runs
the eager formulas exactly. Inside a decoder layer compiled whole (`megatron_tc.model.compile`) each
block is the plain formula, fused together with its neighbours by that layer's compile.
MEGATRON_TC_COMPILE=force compiles on CPU too (tests of the compiled path). A compile that fails
warns once and runs eagerly from then on.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

_COMPILED: dict[str, Callable] = {}
_EAGER_DEPTH = 0  # > 0 inside `eager_formulas()`


def _mode() -> str:
    return "0" if _EAGER_DEPTH else os.environ.get("MEGATRON_TC_COMPILE", "1")


@contextlib.contextmanager
def eager_formulas():
    """Within: every block runs its eager formula, as MEGATRON_TC_COMPILE=0 would (a CUDA graph
    captured from warm-up steps must find the kernels those steps ran)."""
    global _EAGER_DEPTH
    _EAGER_DEPTH += 1
    try:
        yield
    finally:
        _EAGER_DEPTH -= 1


def fused(name: str, fn: Callable, x: torch.Tensor) -> Callable:
    """The function to call for tensor `x`: compiled (see the module docstring) or `fn`."""
    if torch.compiler.is_compiling():
        return fn  # inside a compiled decoder layer (model/compile.py): traced into that graph
    mode = _mode()
    if mode == "0" or (not x.is_cuda and mode != "force") or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return fn
    if name not in _COMPILED:
        _configure_compiler()
        _COMPILED[name] = with_eager_fallback(torch.compile(fn, dynamic=False), fn, name)
    return _COMPILED[name]


def _configure_compiler(limit: int = 64) -> None:
    """One block sees several dtypes, grad modes, ranks and shapes (RMSNorm: residual stream, q/k
    norms, GDN output norm; student and teacher; static shapes, dynamic=False, so the training
    shape gets kernels specialized to it); torch's default of 8 variants per function would send
    the rest back to eager without a word."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # round where the eager formula rounds (bf16 RMSNorm: x_hat to bf16, then times the weight);
    # without it inductor keeps such intermediates in fp32 and the result moves by bf16 rounding
    if hasattr(inductor_config, "emulate_precision_casts"):
        inductor_config.emulate_precision_casts = True

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key) and getattr(dynamo_config, key) < limit:
            setattr(dynamo_config, key, limit)


def with_eager_fallback(compiled: Callable, fn: Callable, name: str) -> Callable:
    """`compiled`; if compiling or running it fails (no working Triton/inductor toolchain), warn once
    and call the eager `fn` from then on: the same numbers, only slower."""
    state = {"use": compiled}

    def call(*args):
        try:
            if state["use"] is compiled:
                args = aligned(args)
            return state["use"](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - the eager rerun raises any real error again
            if state["use"] is fn:
                raise
            warnings.warn(f"torch.compile of {name!r} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                          "running it eagerly", RuntimeWarning, stacklevel=2)
            state["use"] = fn
            return fn(*args)

    return call


ALIGNMENT_BYTES = 16


def aligned(args: tuple) -> tuple:
    """`args` with every tensor whose data does not start on a 16-byte boundary replaced by a copy
    (autograd flows through the copy). Inductor may load parameters with 16-byte vector loads once it
    has seen them aligned at compile time. ZeRO-3 hands out parameters as views into its gathered
    flat buffer, packed end to end: after SmolLM2's nine-head A_log (18 bytes in bf16) every view
    is misaligned, which the 1.1B model (sizes all multiples of 8) never shows, and only SmolLM2's
    compiled ZeRO-3 step died with CUDA "misaligned address" (H200). Suspected, not yet
    confirmed as the cause (tests/gpu/test_fused_model_cuda.py). Aligned tensors pass through
    untouched; the copies are of the small parameters that follow such odd sizes."""
    if not any(isinstance(a, torch.Tensor) and a.data_ptr() % ALIGNMENT_BYTES for a in args):
        return args
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a.data_ptr() % ALIGNMENT_BYTES else a for a in args)


# ---- the blocks (eager formulas; keep them identical to what the modules computed before) ---------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm in fp32, Hugging Face's rounding order (see norm.RMSNorm)."""
    dtype = x.dtype
    xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x_hat * (1.0 + weight.to(x_hat.dtype))).to(dtype)
    return weight * x_hat.to(dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, max_a_log: float,
              min_log_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN log decay g and write strength beta [B, T, H] fp32 from a_proj / b_proj outputs."""
    rate = a_log.float().clamp(max=max_a_log).exp()
    g = (-rate * F.softplus(a.float() + dt_bias.float())).clamp(min=min_log_decay)
    return g, torch.sigmoid(b.float())


def gated_output(normed: torch.Tensor, gate_pre: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(normed * SiLU(gate_pre in fp32)).to(dtype); normed [B, T, H, D], gate_pre [B, T, H * D]."""
    return (normed * F.silu(gate_pre.float()).view(normed.shape)).to(dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of the gated MLP."""
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up
