"""Gated DeltaNet layer (docs/method.md section 1), parameter names compatible with fla's `GatedDeltaNet`.

    q, k, v = act(q_proj x), act(k_proj x), act(v_proj x)     act: short conv + SiLU, or SiLU only
    g       = -exp(A_log) * softplus(a_proj x + dt_bias)       log decay per head  [B, T, H]
    beta    = sigmoid(b_proj x)                                write strength      [B, T, H]
    o       = gated_delta_rule(l2norm(q) * Dk^-1/2, l2norm(k), v, g, beta)
    out     = o_proj(RMSNorm(o) * o_norm.weight * SiLU(g_proj x))

k/v have `gdn_kv_heads` heads; with fewer than `num_heads` (gdn_expand_kv=False) they are
repeated to the query heads at run time, as GQA does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import GDNCache
from .config import ArchConfig
from .fused import fused, gated_output, gdn_gates
from .norm import RMSNorm
from .ops.gated_delta_rule import BACKENDS, PackedRows, gated_delta_rule


def causal_short_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [B, T, C], weight [C, 1, K], state [B, C, K-1] (inputs
    before x). Taps across a document boundary of doc_ids [B, T] are dropped. Returns
    (y [B, T, C], new state [B, C, K-1])."""
    b, t, c = x.shape
    width = weight.shape[-1]
    past = x.new_zeros(b, width - 1, c) if state is None else state.transpose(1, 2).to(x.dtype)
    padded = torch.cat([past, x], dim=1)  # [B, T + K - 1, C]
    y = torch.zeros_like(x)
    for lag in range(width):
        tap = padded[:, width - 1 - lag : width - 1 - lag + t] * weight[:, 0, width - 1 - lag]
        if doc_ids is not None and lag:
            same = torch.zeros_like(doc_ids, dtype=torch.bool)
            same[:, lag:] = doc_ids[:, lag:] == doc_ids[:, :-lag]
            tap = tap * same[..., None].to(x.dtype)
        y = y + tap
    return F.silu(y), padded[:, padded.shape[1] - (width - 1) :].transpose(1, 2)

# a compiled decoder layer breaks its graph here: fla's Triton kernels (and the PyTorch chunked
# path) run as they are, the projections and gates before and the output gate after are compiled
_delta_rule_outside_graph = torch.compiler.disable(gated_delta_rule, recursive=True)

MAX_A_LOG = 30.0  # exp(30) ~ 1e13: far beyond any trained decay rate, still finite in fp32
MIN_LOG_DECAY = -1e4


def decay_and_write(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay g and write strength beta [B, T, H] fp32 from the a_proj / b_proj outputs [B, T, H]
    and the per-head A_log, dt_bias [H]. Per head and token: several layers' heads side by side
    (their outputs and parameters concatenated) give each layer's values."""
    return fused("gdn_gates", gdn_gates, a)(a, b, a_log, dt_bias, MAX_A_LOG, MIN_LOG_DECAY)


def convolved_heads(
    projected: list[torch.Tensor], conv_weights: list[torch.Tensor] | None, head_dim: int, kv_group: int,
    doc_ids: torch.Tensor | None = None, states: list[torch.Tensor | None] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """((q [B, T, H, D], k, v [B, T, Hkv * kv_group, D]), new conv states) from the q/k/v projections
    [B, T, C]: each through its causal conv + SiLU (conv_weights [C, 1, K] each; None: SiLU only)
    with `states` before it, split into heads, k/v heads repeated `kv_group` times. Per channel and
    head: several layers' channels side by side (projections and conv weights concatenated) give
    each layer's heads side by side."""
    b, t, _ = projected[0].shape
    out, new_states = [], []
    for i, y in enumerate(projected):
        if conv_weights is not None:
            y, state = causal_short_conv(y, conv_weights[i], states[i] if states is not None else None, doc_ids)
            new_states.append(state)
        else:
            y = F.silu(y)
        out.append(y.view(b, t, -1, head_dim))
    q, k, v = out
    if kv_group > 1:
        k, v = k.repeat_interleave(kv_group, dim=2), v.repeat_interleave(kv_group, dim=2)
    return (q, k, v), new_states


def default_a_log(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fla's default A_log, shaped and typed as `like` [H]: log A with A ~ U(0, 16)."""
    return torch.empty_like(like).uniform_(0, 16, generator=generator).log()


def default_dt_bias(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fla's default dt_bias [H]: the inverse softplus of dt, log-uniform in (1e-3, 0.1), at least 1e-4."""
    uniform = torch.empty_like(like).uniform_(generator=generator)
    dt = torch.exp(uniform * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class GatedDeltaNet(nn.Module):
    """x [B, T, hidden] -> [B, T, hidden]. `backend` selects the gated delta rule kernel.
    init=False skips the gate parameters' random init (A_log and dt_bias stay zero), for a module
    whose weights are all assigned right after (built on `meta`, the Linear inits cost nothing)."""

    def __init__(self, arch: ArchConfig, layer_idx: int, init: bool = True) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = arch.num_heads, arch.gdn_kv_heads, arch.head_dim
        self.chunk_size = arch.gdn_chunk_size
        self.conv_size = arch.gdn_conv_size
        self.backend = "auto"
        h, d, hidden = arch.num_heads, arch.head_dim, arch.hidden_size
        self.q_proj = nn.Linear(hidden, h * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=arch.attention_bias)
        self.a_proj = nn.Linear(hidden, h, bias=False)
        self.b_proj = nn.Linear(hidden, h, bias=arch.gdn_b_bias)
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.g_proj = nn.Linear(hidden, h * d, bias=False)
        self.o_norm = RMSNorm(d, arch.norm_eps)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        if self.conv_size > 0:
            for name, channels in (("q", h * d), ("k", self.kv_heads * d), ("v", self.kv_heads * d)):
                setattr(self, f"{name}_conv1d", nn.Conv1d(channels, channels, self.conv_size, groups=channels, bias=False))
        if init:
            self.reset_gdn_parameters()

    def reset_gdn_parameters(self, generator: torch.Generator | None = None) -> None:
        """fla's defaults for A_log and dt_bias (`default_a_log`, then `default_dt_bias`), drawn
        from `generator` (default: the global one); a zero b_proj bias."""
        with torch.no_grad():
            self.A_log.copy_(default_a_log(self.A_log, generator))
            self.dt_bias.copy_(default_dt_bias(self.dt_bias, generator))
            if self.b_proj.bias is not None:
                self.b_proj.bias.zero_()

    def set_backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is unknown; use one of {BACKENDS}")
        self.backend = backend

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decay g and write strength beta, both [B, T, H] in fp32."""
        # exp(A_log) must stay finite: inf * softplus(...) = inf * 0 is NaN. A decay below -1e4
        # per token is already exp(-1e4) = 0, so the floor changes no value, only avoids -inf.
        return decay_and_write(self.a_proj(x), self.b_proj(x), self.A_log, self.dt_bias)

    def qkv(
        self, x: torch.Tensor, doc_ids: torch.Tensor | PackedRows | None = None, cache: GDNCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k, v [B, T, H, D] (k/v repeated to H heads), before the L2 norm."""
        if isinstance(doc_ids, PackedRows):  # the convolution's masks: device ops of fixed shape
            doc_ids = doc_ids.doc_ids
        projected = [getattr(self, f"{name}_proj")(x) for name in "qkv"]
        weights = [getattr(self, f"{name}_conv1d").weight for name in "qkv"] if self.conv_size > 0 else None
        states = [cache.conv.get(name) for name in "qkv"] if cache is not None and weights else None
        group = self.num_heads // self.kv_heads
        (q, k, v), new_states = convolved_heads(projected, weights, self.head_dim, group, doc_ids, states)
        if cache is not None and weights:
            cache.conv.update(zip("qkv", new_states))
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | PackedRows | None = None,
        cache: GDNCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden]; position_ids unused (GDN has no positions); doc_ids [B, T] resets state
        (or `PackedRows` of them: fla's layout precomputed, no host read, as a CUDA graph needs)."""
        if cache is not None and doc_ids is not None:
            raise ValueError("doc_ids (packed documents) cannot be combined with a decoding cache")
        b, t, _ = x.shape
        q, k, v = self.qkv(x, doc_ids, cache)
        g, beta = self.gates(x)
        backend = self.backend
        if backend == "auto" and not x.is_cuda and t <= 16:
            backend = "recurrent"  # a few decoding steps: no chunk padding
        o, state = _delta_rule_outside_graph(
            q, k, v, g, beta,
            scale=self.head_dim**-0.5,
            initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None,
            doc_ids=doc_ids,
            use_qk_l2norm=True,
            chunk_size=self.chunk_size,
            backend=backend,
        )
        if cache is not None:
            cache.state, cache.seen = state, cache.seen + t
        gate_pre = self.g_proj(x)
        normed = self.o_norm(o.float())
        o = fused("gdn_gated_output", gated_output, normed)(normed, gate_pre, x.dtype)
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))
