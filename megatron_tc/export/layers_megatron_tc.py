"""Layers of a megatron_tc hybrid student (torch only): softmax attention, Gated DeltaNet, MLP,
decoder layer and the whole stack (megatron_tc's `HybridLM` layout and parameter names).

Numerics follow megatron_tc's model op for op (RMSNorm in fp32 with Hugging Face's rounding order,
RoPE tables in fp32, GDN gates in fp32), so an export reproduces the in-package logits.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cache_megatron_tc import AttentionLayerCache, GDNLayerCache, MegatronTCCache
from .configuration_megatron_tc import MegatronTCConfig
from .gated_delta_megatron_tc import causal_conv, fused_decode_step, gated_delta_rule

MAX_A_LOG, MIN_LOG_DECAY = 30.0, -1e4
# Masked attention on CUDA avoids cuDNN's kernel: it builds a plan per key length (milliseconds of
# host time per call while the cache grows), and that planning cannot be captured in a CUDA graph.
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Batch:
    """What every layer needs to know about one forward: offset (tokens already cached), slots
    [T] (their cache positions), valid [B, T] (False at padding, or None), key_valid [B, L] (or None)."""

    def __init__(self, offset: int, slots: torch.Tensor, valid: torch.Tensor | None,
                 key_valid: torch.Tensor | None, kv_len: int | None) -> None:
        self.offset, self.slots, self.valid, self.key_valid, self.kv_len = offset, slots, valid, key_valid, kv_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] rotated by positions [B, T]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


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
        local = sliding and a("rope_local_theta") is not None
        self.rope = Rotary(self.head_dim, a("rope_local_theta") if local else a("rope_theta"),
                           None if local else a("rope_scaling"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                cache: AttentionLayerCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), positions), self.rope(k.transpose(1, 2), positions)
        if cache is not None:
            k, v = cache.update(k, v, batch.offset, batch.slots, batch.kv_len)
        group = self.heads // self.kv_heads
        if batch.key_valid is None and self.window is None and k.shape[2] == t:  # no padding, no past
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=group > 1)
        else:
            mask = self.mask(batch, k.shape[2], x.device)  # [B or 1, 1, T, L]
            with sdpa_kernel(MASKED_SDPA_BACKENDS) if x.is_cuda else nullcontext():
                if t == 1:  # one query per row: group the query heads, no K/V copies
                    o = F.scaled_dot_product_attention(q.reshape(b, self.kv_heads, group, self.head_dim), k, v,
                                                       attn_mask=mask, scale=self.scale).reshape(b, self.heads, 1, -1)
                else:
                    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

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


class GatedDeltaNet(nn.Module):
    """o_proj(RMSNorm(gated_delta_rule(...)) * SiLU(g_proj x)); names as fla's GatedDeltaNet."""

    def __init__(self, config: MegatronTCConfig, layer_idx: int) -> None:
        super().__init__()
        a = config.arch_value
        h, d, hidden = a("num_heads"), a("head_dim"), a("hidden_size")
        self.heads, self.head_dim = h, d
        self.kv_heads = h if a("gdn_expand_kv") else a("num_kv_heads")
        self.conv_size, self.chunk = a("gdn_conv_size"), a("gdn_chunk_size")
        self.backend = "auto"
        self.q_proj = nn.Linear(hidden, h * d, bias=a("attention_bias"))
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=a("attention_bias"))
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=a("attention_bias"))
        self.a_proj = nn.Linear(hidden, h, bias=False)
        self.b_proj = nn.Linear(hidden, h, bias=a("gdn_b_bias"))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.g_proj = nn.Linear(hidden, h * d, bias=False)
        self.o_norm = RMSNorm(d, a("norm_eps"))
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        if self.conv_size > 0:
            for name, channels in (("q", h * d), ("k", self.kv_heads * d), ("v", self.kv_heads * d)):
                setattr(self, f"{name}_conv1d",
                        nn.Conv1d(channels, channels, self.conv_size, groups=channels, bias=False))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                cache: GDNLayerCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        keep = None if batch.valid is None else batch.valid[..., None].to(x.dtype)  # [B, T, 1]
        qkv, conv_inputs = [], {}
        for name in ("q", "k", "v"):
            y = getattr(self, f"{name}_proj")(x)
            if keep is not None:
                y = y * keep  # a pad position feeds zeros, exactly like the start of a sequence
            if self.conv_size > 0:
                past = cache.conv.get(name) if cache is not None and batch.offset > 0 else None
                y, conv_inputs[name] = causal_conv(y, getattr(self, f"{name}_conv1d").weight, past)
            else:
                y = F.silu(y)
            qkv.append(y.view(b, t, -1, self.head_dim))
        q, k, v = qkv
        if self.kv_heads != self.heads:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        a, bb = self.a_proj(x), self.b_proj(x)
        state = cache.state if cache is not None and batch.offset > 0 else None
        if (t == 1 and x.is_cuda and state is not None and batch.valid is None and not cache.recording
                and self.backend in ("auto", "fla") and not torch.is_grad_enabled()):
            out = self.fused_step(x, q, k, v, a, bb, cache, conv_inputs)
            if out is not None:
                return out
        rate = self.A_log.float().clamp(max=MAX_A_LOG).exp()
        g = (-rate * F.softplus(a.float() + self.dt_bias.float())).clamp(min=MIN_LOG_DECAY)
        beta = torch.sigmoid(bb.float())
        if batch.valid is not None:  # decay 1 and no write: the state passes a pad unchanged
            g, beta = g * batch.valid[..., None], beta * batch.valid[..., None]
            k, v = k * keep[..., None], v * keep[..., None]
        if cache is not None:
            cache.remember(conv_inputs, k, v, g, beta)
        o, final = gated_delta_rule(q, k, v, g, beta, self.head_dim**-0.5, state, self.chunk, self.backend)
        if cache is not None:
            width = self.conv_size - 1
            cache.store(final, {n: c[:, :, c.shape[2] - width:] for n, c in conv_inputs.items()})
        normed = self.o_norm(o.float())
        o = (normed * F.silu(self.g_proj(x).float()).view(normed.shape)).to(x.dtype)
        return self.o_proj(o.reshape(b, t, self.heads * self.head_dim))


    def fused_step(self, x, q, k, v, a, bb, cache: GDNLayerCache, conv_inputs) -> torch.Tensor | None:
        """One decoding token through fla's fused kernels (gates, L2 norm, recurrence; gated norm),
        or None where they are unavailable."""
        b, t, _ = x.shape
        gate = self.g_proj(x).view(b, t, self.heads, self.head_dim)
        fused = fused_decode_step(q, k, v, a, bb, self.A_log, self.dt_bias, self.head_dim**-0.5, cache.state, gate,
                                  self.o_norm.weight, self.o_norm.eps)
        if fused is None:
            return None
        cache.store(fused[1], {n: c[:, :, c.shape[2] - (self.conv_size - 1):] for n, c in conv_inputs.items()})
        return self.o_proj(fused[0].reshape(b, t, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: MegatronTCConfig, layer_idx: int) -> None:
        super().__init__()
        a = config.arch_value
        kind = (a("layer_pattern").replace("|", "") or "A" * a("num_layers"))[layer_idx]
        norm = lambda: RMSNorm(a("hidden_size"), a("norm_eps"), a("norm_unit_offset"))  # noqa: E731
        self.input_norm = norm()
        self.mixer = Attention(config, layer_idx) if kind == "A" else GatedDeltaNet(config, layer_idx)
        self.post_attn_norm = norm() if a("sandwich_norm") else None
        self.pre_mlp_norm = norm()
        self.mlp = GatedMLP(a("hidden_size"), a("intermediate_size"), a("mlp_activation"))
        self.post_mlp_norm = norm() if a("sandwich_norm") else None

    def forward(self, x, positions, batch, cache):
        h = self.mixer(self.input_norm(x), positions, batch, cache)
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        h = self.mlp(self.pre_mlp_norm(x))
        return x + (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))


class HybridModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (megatron_tc's HybridLM layout)."""

    def __init__(self, config: MegatronTCConfig) -> None:
        super().__init__()
        a = config.arch_value
        self.vocab_size, self.embed_scale, self.softcap = a("vocab_size"), a("embed_scale"), a("final_logit_softcap")
        rows = max(a("padded_vocab_size") or 0, a("vocab_size"))
        self.embed_tokens = nn.Embedding(rows, a("hidden_size"))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(a("num_layers")))
        self.norm = RMSNorm(a("hidden_size"), a("norm_eps"), a("norm_unit_offset"))
        self.lm_head = None if a("tie_embeddings") else nn.Linear(a("hidden_size"), rows, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                cache: MegatronTCCache | None, logits_to_keep: int = 0) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, batch, cache.layers[i] if cache is not None else None)
        x = self.norm(x[:, -logits_to_keep:] if logits_to_keep else x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ weight[: self.vocab_size].t()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
