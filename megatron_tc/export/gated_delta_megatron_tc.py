"""The gated delta rule and the short causal convolution of an exported student (torch only).

Layout as flash-linear-attention: q, k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H] (log decay
<= 0), beta [B, T, H], state [B, H, Dk, Dv]; per head
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t).
A position with g = 0 and beta = 0 leaves the state exactly unchanged: that is how padding is
skipped. On CUDA, fla's Triton kernels run when fla is importable; elsewhere a PyTorch chunked
form (prefill) or the step-by-step recurrence (a few tokens) computes the same thing in fp32.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings

import torch
import torch.nn.functional as F

_FLA: dict[str, object] = {}


# (name, modules to try in turn, attribute): fla's fused kernels beyond the GDN recurrence; a
# layout this fla lacks leaves the name out and the PyTorch form runs instead
_FLA_EXTRAS = (("gated_norm", ("fla.modules.norm.fused_norm_gate", "fla.modules.fused_norm_gate"), "rms_norm_gated"),
               ("rms_norm", ("fla.modules.norm.layernorm", "fla.modules.layernorm"), "rms_norm"),
               ("swiglu", ("fla.modules.activations",), "swiglu"),
               ("l2norm", ("fla.modules.norm.l2norm", "fla.modules.l2norm"), "l2norm_fwd"),
               ("chunk_forward", ("fla.ops.gated_delta_rule.chunk",), "chunk_gated_delta_rule_fwd"))


def fla_kernels() -> dict[str, object] | None:
    """fla's chunk and fused-recurrent kernels (and, when this fla has them, its fused gated
    RMSNorm "gated_norm", residual-add + RMSNorm "rms_norm" and "swiglu"), or None where fla (or
    CUDA) is missing."""
    if not _FLA:
        ok = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
        if ok:
            try:  # imported by name so transformers' remote-code check does not require fla
                ops = importlib.import_module("fla.ops.gated_delta_rule")
                _FLA.update(chunk=ops.chunk_gated_delta_rule, recurrent=ops.fused_recurrent_gated_delta_rule)
            except Exception:  # noqa: BLE001 - a broken fla install falls back to PyTorch
                ok = False
        for name, modules, attr in _FLA_EXTRAS if ok else ():
            for where in modules:
                try:
                    _FLA.setdefault(name, getattr(importlib.import_module(where), attr))
                except Exception:  # noqa: BLE001 - older or newer layouts: the unfused form is used
                    continue
        _FLA.setdefault("ok", ok)
    return _FLA if _FLA["ok"] else None


def fla_op(name: str, *args, **kwargs):
    """fla's fused `name` applied to CUDA tensors, or None (the caller then runs its PyTorch form)
    where fla lacks it or it failed once: it is then not tried again, with one warning. A first
    call happens outside CUDA-graph capture (the capture's warm-up), so a failure never breaks one."""
    kernels = fla_kernels()
    fn = kernels.get(name) if kernels is not None and name not in _BROKEN else None
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of an optional kernel: the PyTorch form is exact
        _BROKEN.add(name)
        warnings.warn(f"fla's fused {name} failed ({type(exc).__name__}: {str(exc)[:160]}); using PyTorch ops",
                      RuntimeWarning, stacklevel=2)
        return None


_BROKEN: set[str] = set()
_GRAPH_WORK = [0]  # > 0 while a forward is warmed up and captured as a CUDA graph


@contextlib.contextmanager
def graph_work():
    """Inside: the forward becomes a CUDA graph (its warm-up, then its capture), where fla's fused
    small kernels pay: the replay launches nothing from the host. The warm-up runs them first,
    outside the capture (Triton compiles and autotunes there)."""
    _GRAPH_WORK[0] += 1
    try:
        yield
    finally:
        _GRAPH_WORK[0] -= 1


def fused_small_kernels(x: torch.Tensor) -> bool:
    """Whether inference on x [B, T, ...] takes fla's fused residual-add + RMSNorm and SwiGLU: on
    CUDA inside `graph_work`, and for decoding steps (T = 1), whose eager and captured forms then
    run the same kernels. An eager prefill takes PyTorch's: there fla's Python wrappers cost more
    host time than PyTorch's two kernels, and a host-bound prefill pays for every launch."""
    return x.is_cuda and not torch.is_grad_enabled() and (_GRAPH_WORK[0] > 0 or x.shape[1] == 1)


def fused_decode_step(q, k, v, a, b, a_log, dt_bias, scale: float, state: torch.Tensor | None, gate: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A few decoding tokens of a GDN layer in two fla kernels: the recurrence with the decay
    (-exp(A_log) softplus(a + dt_bias)), the write strength (sigmoid(b)) and the q/k L2 norm computed
    inside, then RMSNorm(o) * weight * SiLU(gate). a, b [B, T, H] are the raw a_proj / b_proj
    outputs, gate [B, T, H, D]. Returns (normed output [B, T, H, D], state) or None where fla lacks
    these kernels (the caller then runs the unfused path)."""
    kernels = fla_kernels()
    if kernels is None or "gated_norm" not in kernels or not _FUSED["ok"]:
        return None
    try:
        o, final = kernels["recurrent"](q=q, k=k, v=v, g=a, beta=b, scale=scale, initial_state=state,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        return kernels["gated_norm"](o, gate, norm_weight, None, activation="swish", eps=eps), final
    except (TypeError, ValueError) as exc:  # an fla without these options: unfused from now on
        _FUSED["ok"] = False
        warnings.warn(f"fla's fused GDN decoding step is unavailable ({exc}); using the unfused kernels",
                      RuntimeWarning, stacklevel=2)
        return None


_FUSED = {"ok": True}


def fused_chunk_rule(q, k, v, a, b, a_log, dt_bias, scale: float, state: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`gated_delta_rule` (backend "auto") with the decay computed inside fla's kernels from the raw
    a_proj output a [B, T, H]; the write strength sigmoid(b) is PyTorch's (fla's kernel for it costs
    more host time). Returns (o [B, T, H, Dv], final state), or None off CUDA, without fla or with an
    fla lacking the options (the caller then computes the gates). The kernels skip
    `GatedDeltaNet.gates`' clamps of A_log and of the log decay, which change only decays below
    exp(-1e4) a token (zero in fp32 either way)."""
    kernels = fla_kernels() if q.is_cuda and _FUSED["ok"] else None
    if kernels is None:
        return None
    beta, init = torch.sigmoid(b.float()), None if state is None else state.float()
    inference = not torch.is_grad_enabled()
    fn = kernels["recurrent"] if q.shape[1] <= 64 and inference else kernels["chunk"]
    if fn is kernels["chunk"] and inference:
        out = chunk_forward_only(kernels, q, k, v, a, beta, a_log, dt_bias, scale, init)
        if out is not None:
            return out
    try:
        return fn(q=q, k=k, v=v, g=a, beta=beta, scale=scale, initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
    except (TypeError, ValueError) as exc:  # an fla without these options: unfused from now on
        _FUSED["ok"] = False
        warnings.warn(f"fla's GDN kernels with the gates inside are unavailable ({exc}); using the unfused kernels",
                      RuntimeWarning, stacklevel=2)
        return None


def chunk_forward_only(kernels: dict, q, k, v, a, beta, a_log, dt_bias, scale: float, state: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fla's chunk forward without its autograd Function, for inference: an eager prefill is bound
    by the host, and the Function's bookkeeping (contiguity guards, saved tensors) is host time no
    backward uses. q and k are L2-normalised by fla's kernel first, as the Function does. Returns
    (o, final state) as `fused_chunk_rule`, or None where this fla lacks these functions or its
    forward takes or returns something else (then, with one warning, the Function from now on)."""
    if "l2norm" not in kernels or "chunk_forward" not in kernels or not _FORWARD_ONLY["ok"]:
        return None
    b, _, h, dk = k.shape
    device = contextlib.nullcontext() if q.device.index == torch.cuda.current_device() else torch.cuda.device(q.device)
    try:
        with device:  # fla's kernels launch on the current device
            qn, kn = (kernels["l2norm"](z.contiguous())[0] for z in (q, k))
            out = kernels["chunk_forward"](q=qn, k=kn, v=v.contiguous(), g=a.contiguous(), beta=beta, scale=scale,
                                           initial_state=state, output_final_state=True, use_gate_in_kernel=True,
                                           A_log=a_log, dt_bias=dt_bias)
        o, final = out[1], out[3]  # (g, o, A, final state, ...) in fla's forward
        if o.shape != v.shape or final.shape != (b, h, dk, v.shape[-1]):
            raise ValueError(f"fla's chunk forward returned shapes {[getattr(x, 'shape', x) for x in out]}")
    except (TypeError, ValueError, IndexError) as exc:
        _FORWARD_ONLY["ok"] = False
        warnings.warn(f"fla's chunk forward cannot be called without its autograd Function ({exc}); using the Function",
                      RuntimeWarning, stacklevel=2)
        return None
    return o.to(q.dtype), final


_FORWARD_ONLY = {"ok": True}


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_rule(q, k, v, g, beta, scale: float, state: torch.Tensor | None):
    """Step by step; returns (o [B, T, H, Dv] in v's dtype, final state fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q, k = l2norm(q) * scale, l2norm(k)
    b, t, h, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.float()
    outs = []
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s)) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], s))
    return torch.stack(outs, 1).to(dtype), s


def chunk_rule(q, k, v, g, beta, scale: float, state: torch.Tensor | None, chunk: int = 64):
    """Chunked WY form (one triangular solve per chunk); same result as `recurrent_rule`."""
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q, k = l2norm(q) * scale, l2norm(k)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk

    def split(x):  # [B, T, H, (D)] -> [B, H, N, C, (D)], zero padded (a zero step changes nothing)
        x = x.transpose(1, 2)
        x = (F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))) if pad else x
        return x.reshape(b, h, -1, chunk, *x.shape[3:])

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = (k @ k.transpose(-1, -2) * decay * beta[..., :, None]).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([k * (beta * cum.exp())[..., None], v * beta[..., None]], -1)
    w, u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split([dk, dv], -1)
    q_in, qk = q * cum.exp()[..., None], q @ k.transpose(-1, -2) * decay
    k_out, carry = k * decay[..., -1, :, None], cum[..., -1].exp()
    s = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    outs = []
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_in[:, :, i] @ s + qk[:, :, i] @ v_new)
        s = s * carry[:, :, i, None, None] + k_out[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(b, h, -1, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), s


def gated_delta_rule(q, k, v, g, beta, scale: float, state: torch.Tensor | None, chunk: int = 64,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, H, Dv], final state [B, H, Dk, Dv] (fp32). q and k are L2-normalized inside.

    backend: "auto" (fla on CUDA when importable; else chunked, or recurrent for <= 16 tokens),
    "fla", "chunk" or "recurrent"."""
    t = q.shape[1]
    kernels = fla_kernels() if q.is_cuda and backend in ("auto", "fla") else None
    if kernels is not None:
        fn = kernels["recurrent"] if t <= 64 and not torch.is_grad_enabled() else kernels["chunk"]
        init = None if state is None else state.float()
        o, final = fn(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=init,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, final
    if backend == "fla":
        raise ValueError("backend 'fla' needs CUDA tensors and flash-linear-attention installed")
    if backend == "recurrent" or (backend == "auto" and t <= 16):
        return recurrent_rule(q, k, v, g, beta, scale, state)
    return chunk_rule(q, k, v, g, beta, scale, state, chunk)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (the caller applies the SiLU). x [B, T, C], weight [C, 1, K], past
    [B, C, K-1] (the inputs before x; zeros at the start). Returns (y [B, T, C], all inputs [B, C, K-1+T])."""
    b, t, c = x.shape
    width = weight.shape[-1]
    past = x.new_zeros(b, c, width - 1) if past is None else past.to(x.dtype)
    inputs = torch.cat([past, x.transpose(1, 2)], dim=2)
    y = F.conv1d(inputs, weight.to(x.dtype), groups=c)
    return y.transpose(1, 2), inputs
