"""Building blocks of a megatron_tc hybrid student (torch only): the per-forward `Batch`, packed
weights for decoding, RMSNorm, RoPE and softmax attention (megatron_tc's parameter names).

Numerics follow megatron_tc's model op for op on CPU (RMSNorm in fp32 with Hugging Face's rounding
order, RoPE tables in fp32), so an export reproduces the in-package logits.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cache_megatron_tc import AttentionLayerCache
from .configuration_megatron_tc import MegatronTCConfig

# Masked attention on CUDA avoids cuDNN's kernel: it builds a plan per key length (milliseconds of
# host time per call while the cache grows), and that planning cannot be captured in a CUDA graph.
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Causal prompts: flash first. cuDNN (torch's first choice on Hopper) builds a plan for every new
# sequence length, about 50 ms on an H200: more than a whole 4k-token prefill of a small model.
CAUSAL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH]


class Batch:
    """What every layer needs to know about one forward: offset (tokens already cached), slots
    [T] (their cache positions), valid [B, T] (False at padding, or None), key_valid [B, L] (or None),
    end ([1] long on the device, or None): the prompt's real tokens end there and padding follows
    (a captured prefill's bucket); the cache keeps the state at `end`, the logits are those before it.

    `memo` holds what all layers of one kind share in this forward (RoPE tables, the decoding
    step's attention bias), computed by the first layer that needs it instead of once per layer."""

    def __init__(self, offset: int, slots: torch.Tensor, valid: torch.Tensor | None,
                 key_valid: torch.Tensor | None, kv_len: int | None, end: torch.Tensor | None = None) -> None:
        self.offset, self.slots, self.valid, self.key_valid, self.kv_len = offset, slots, valid, key_valid, kv_len
        self.end = end
        self.memo: dict = {}

    def shared(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


class Packed:
    """The concatenation (dim 0) of some parameters, kept for single-matmul inference and rebuilt
    whenever one of them is moved, cast or edited in place (their address or version changes).
    A part given as an int is that many zeros (a missing bias). When gradients must reach the
    parameters (`trains`), the concatenation is made in the autograd graph at each call instead."""

    def __init__(self) -> None:
        self.key, self.value = None, None

    def get(self, parts: list) -> torch.Tensor:
        tensors = [p for p in parts if not isinstance(p, int)]
        if trains(tensors):
            return torch.cat([tensors[0].new_zeros(p) if isinstance(p, int) else p for p in parts])
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in tensors)
        if key != self.key:
            ref = tensors[0]
            self.value = torch.cat([ref.new_zeros(p) if isinstance(p, int) else p.detach() for p in parts])
            self.key = key
        return self.value


def trains(weights: list[torch.Tensor]) -> bool:
    """Whether a forward must reach these weights' gradients (a detached copy would give none)."""
    return torch.is_grad_enabled() and any(w.requires_grad for w in weights)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not self.unit_offset and x.dtype in (self.weight.dtype, torch.float32):
            # one fused kernel (fp32 inside) instead of seven, also for fp32 inputs of a bf16 model
            # (the gated norm's); on CPU the reference rounding order below
            return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)
        dtype = x.dtype
        xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x_hat * (1.0 + self.weight.to(x_hat.dtype))).to(dtype)
        return self.weight * x_hat.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32 on the CPU: default, linear or Llama-3 scaled frequencies."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")
    return inv


class Rotary(nn.Module):
    """fp32 inverse frequencies (a buffer recomputed on every move or cast: never bf16)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, float(theta), dict(scaling) if scaling else None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, self.theta, self.scaling), persistent=False)

    def reset(self) -> None:
        device = self.inv_freq.device
        fresh = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        self.inv_freq = torch.empty_like(fresh, device=device) if device.type == "meta" else fresh.to(device)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.reset()
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] in `dtype` for positions [B, T]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] rotated by positions [B, T]."""
        return self.rotate(x, *self.tables(positions, x.dtype))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row: q [B, Hq, 1, D], k, v [B, Hkv, L, D], bias [B or 1, 1, 1, L] (0 where
    visible, -inf elsewhere) -> o [B, Hq, 1, D]; the query heads of a group read their KV head
    through a reshape (no K/V copies). Two matmuls and an fp32 softmax, parallel over the L keys:
    SDPA's fused kernels split the work over queries, and a decoding step has one per head, so a
    long cache ran on a handful of thread blocks whatever the batch size."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    scores = (q.reshape(b, hkv, hq // hkv, d) * scale) @ k.transpose(-1, -2) + bias  # fp32 [B, Hkv, G, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).reshape(b, hq, 1, d)


class Attention(nn.Module):
    def __init__(self, config: MegatronTCConfig, layer_idx: int) -> None:
        super().__init__()
        a = config.arch_value
        self.heads, self.kv_heads, self.head_dim = a("num_heads"), a("num_kv_heads"), a("head_dim")
        self.scale = a("query_scale") if a("query_scale") is not None else self.head_dim**-0.5
        types = a("attn_layer_types")
        sliding = (types[layer_idx] if types else ("sliding" if a("sliding_window") else "full")) == "sliding"
        self.window = a("sliding_window") if sliding else None
        hidden, bias = a("hidden_size"), a("attention_bias")
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        if a("qk_norm"):
            self.q_norm = RMSNorm(self.head_dim, a("norm_eps"), a("norm_unit_offset"))
            self.k_norm = RMSNorm(self.head_dim, a("norm_eps"), a("norm_unit_offset"))
        else:
            self.q_norm = self.k_norm = None
        self.packed_qkv, self.packed_bias = Packed(), Packed()
        local = sliding and a("rope_local_theta") is not None
        self.rope = Rotary(self.head_dim, a("rope_local_theta") if local else a("rope_theta"),
                           None if local else a("rope_scaling"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                cache: AttentionLayerCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        if t == 1:  # decoding: one matmul for q, k and v
            weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
            bias = self.packed_bias.get([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) \
                if self.q_proj.bias is not None else None
            qkv = F.linear(x, self.packed_qkv.get(weights), bias)
            q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                 self.kv_heads * self.head_dim], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.heads, self.head_dim)
        k = k.reshape(b, t, self.kv_heads, self.head_dim)
        v = v.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = self.rope  # layers with the same RoPE share its tables within a forward
        cos, sin = batch.shared(("rope", rope.theta, repr(rope.scaling), x.dtype),
                                lambda: rope.tables(positions, x.dtype))
        if t == 1 and self.q_norm is None:  # q and k are neighbours in the packed output: rotate once
            qk = qkv[..., : (self.heads + self.kv_heads) * self.head_dim].reshape(b, 1, -1, self.head_dim)
            qk = rope.rotate(qk.transpose(1, 2), cos, sin)
            q, k = qk.split([self.heads, self.kv_heads], 1)
        else:
            q, k = rope.rotate(q.transpose(1, 2), cos, sin), rope.rotate(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, batch.offset, batch.slots, batch.kv_len)
        group = self.heads // self.kv_heads
        if batch.key_valid is None and self.window is None and k.shape[2] == t:  # no padding, no past
            with sdpa_kernel(CAUSAL_SDPA_BACKENDS, set_priority=True) if x.is_cuda else nullcontext():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=group > 1)
        elif t == 1:
            length = k.shape[2]
            bias = batch.shared(("decode_bias", length, self.window), lambda: self.decode_bias(batch, length, x.device))
            o = decode_attention(q, k, v, bias, self.scale)
        else:
            mask = self.mask(batch, k.shape[2], x.device)  # [B or 1, 1, T, L]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            with sdpa_kernel(MASKED_SDPA_BACKENDS) if x.is_cuda else nullcontext():
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def decode_bias(self, batch: Batch, length: int, device: torch.device) -> torch.Tensor:
        """The mask of one query per row as an additive fp32 bias [B or 1, 1, 1, L] (0 or -inf)."""
        return torch.where(self.mask(batch, length, device), 0.0, float("-inf"))

    def mask(self, batch: Batch, length: int, device: torch.device) -> torch.Tensor:
        """True where query slot i may see key slot j: j <= i, inside the window, not padding; a
        query always sees itself (pad queries then stay finite; their outputs are never used)."""
        diff = batch.slots[:, None] - torch.arange(length, device=device)[None]
        allowed = diff >= 0
        if self.window is not None:
            allowed = allowed & (diff < self.window)
        allowed = allowed[None]
        if batch.key_valid is not None:
            allowed = (allowed & batch.key_valid[:, None, :length]) | (diff == 0)[None]
        return allowed[:, None]
