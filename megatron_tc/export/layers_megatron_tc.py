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
from .gated_delta_megatron_tc import causal_conv, fla_op, fused_decode_step, gated_delta_rule

MAX_A_LOG, MIN_LOG_DECAY = 30.0, -1e4
# Masked attention on CUDA avoids cuDNN's kernel: it builds a plan per key length (milliseconds of
# host time per call while the cache grows), and that planning cannot be captured in a CUDA graph.
MASKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Batch:
    """What every layer needs to know about one forward: offset (tokens already cached), slots
    [T] (their cache positions), valid [B, T] (False at padding, or None), key_valid [B, L] (or None).

    `memo` holds what all layers of one kind share in this forward (RoPE tables, the decoding
    step's attention bias), computed by the first layer that needs it instead of once per layer."""

    def __init__(self, offset: int, slots: torch.Tensor, valid: torch.Tensor | None,
                 key_valid: torch.Tensor | None, kv_len: int | None) -> None:
        self.offset, self.slots, self.valid, self.key_valid, self.kv_len = offset, slots, valid, key_valid, kv_len
        self.memo: dict = {}

    def shared(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


class Packed:
    """The concatenation (dim 0) of some parameters, kept for single-matmul decoding and rebuilt
    whenever one of them is moved, cast or edited in place (their address or version changes).
    A part given as an int is that many zeros (a missing bias)."""

    def __init__(self) -> None:
        self.key, self.value = None, None

    def get(self, parts: list) -> torch.Tensor:
        tensors = [p for p in parts if not isinstance(p, int)]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in tensors)
        if key != self.key:
            ref = tensors[0]
            self.value = torch.cat([ref.new_zeros(p) if isinstance(p, int) else p.detach() for p in parts])
            self.key = key
        return self.value


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not self.unit_offset and x.dtype == self.weight.dtype:
            # one fused kernel (fp32 inside) instead of seven; on CPU the reference rounding order below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
        self.qkv_channels = [h * d, self.kv_heads * d, self.kv_heads * d]
        self.packed_proj, self.packed_bias, self.packed_conv = Packed(), Packed(), Packed()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                cache: GDNLayerCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        state = cache.state if cache is not None and batch.offset > 0 else None
        if (t == 1 and state is not None and batch.valid is None and not cache.recording
                and not torch.is_grad_enabled()):
            return self.decode_step(x, cache)
        keep = None if batch.valid is None else batch.valid[..., None].to(x.dtype)  # [B, T, 1]
        past = cache.conv.get("qkv") if cache is not None and batch.offset > 0 and self.conv_size > 0 else None
        pasts = past.split(self.qkv_channels, 1) if past is not None else (None,) * 3
        qkv, conv_inputs = [], []
        for name, before in zip("qkv", pasts):
            y = getattr(self, f"{name}_proj")(x)
            if keep is not None:
                y = y * keep  # a pad position feeds zeros, exactly like the start of a sequence
            if self.conv_size > 0:
                y, inputs = causal_conv(y, getattr(self, f"{name}_conv1d").weight, before)
                conv_inputs.append(inputs)
            else:
                y = F.silu(y)
            qkv.append(y)
        q, k, v = self.heads_of(*qkv)
        g, beta = self.gates(self.a_proj(x), self.b_proj(x))
        if batch.valid is not None:  # decay 1 and no write: the state passes a pad unchanged
            g, beta = g * batch.valid[..., None], beta * batch.valid[..., None]
            k, v = k * keep[..., None], v * keep[..., None]
        if cache is not None and cache.recording:  # the cache keeps q/k/v conv inputs as one tensor
            cache.remember({"qkv": torch.cat(conv_inputs, 1)} if conv_inputs else {}, k, v, g, beta)
        o, final = gated_delta_rule(q, k, v, g, beta, self.head_dim**-0.5, state, self.chunk, self.backend)
        if cache is not None:
            width = self.conv_size - 1
            tails = [c[:, :, c.shape[2] - width:] for c in conv_inputs]
            cache.store(final, {"qkv": torch.cat(tails, 1)} if tails else {})
        return self.o_proj(self.gated_norm(o, self.g_proj(x).view(b, t, self.heads, self.head_dim)))

    def decode_step(self, x: torch.Tensor, cache: GDNLayerCache) -> torch.Tensor:
        """x [B, 1, hidden] after a prefill: one matmul for q, k, v, a, b and the output gate, one
        convolution step, then (CUDA with fla) the fused recurrence and gated norm."""
        b, h, d = x.shape[0], self.heads, self.head_dim
        layers = (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj)
        biases = [lin.bias if lin.bias is not None else lin.out_features for lin in layers]
        bias = None if all(isinstance(p, int) for p in biases) else self.packed_bias.get(biases)
        y = F.linear(x, self.packed_proj.get([lin.weight for lin in layers]), bias)
        y, a, bb, gate = y.split([sum(self.qkv_channels), h, h, h * d], -1)
        tail = {}
        if self.conv_size > 0:
            y, inputs = causal_conv(y, self.conv_weight(), cache.conv["qkv"])
            tail["qkv"] = inputs[:, :, 1:]
        else:
            y = F.silu(y)
        q, k, v = self.heads_of(*y.split(self.qkv_channels, -1))
        gate = gate.reshape(b, 1, h, d)
        if x.is_cuda and self.backend in ("auto", "fla"):
            fused = fused_decode_step(q, k, v, a, bb, self.A_log, self.dt_bias, d**-0.5, cache.state, gate,
                                      self.o_norm.weight, self.o_norm.eps)
            if fused is not None:
                cache.store(fused[1], tail)
                return self.o_proj(fused[0].reshape(b, 1, h * d))
        g, beta = self.gates(a, bb)
        o, final = gated_delta_rule(q, k, v, g, beta, d**-0.5, cache.state, self.chunk, self.backend)
        cache.store(final, tail)
        return self.o_proj(self.gated_norm(o, gate))

    def conv_weight(self) -> torch.Tensor:
        """The q, k and v convolution weights as one [C, 1, K]."""
        return self.packed_conv.get([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])

    def heads_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, T, channels] -> [B, T, H, D] (k and v expanded to H heads)."""
        b, t, _ = q.shape
        q, k, v = (z.reshape(b, t, -1, self.head_dim) for z in (q, k, v))
        if self.kv_heads != self.heads:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
        return q, k, v

    def gates(self, a: torch.Tensor, bb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), fp32 [B, T, H]."""
        rate = self.A_log.float().clamp(max=MAX_A_LOG).exp()
        g = (-rate * F.softplus(a.float() + self.dt_bias.float())).clamp(min=MIN_LOG_DECAY)
        return g, torch.sigmoid(bb.float())

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) * SiLU(gate) in fp32, o and gate [B, T, H, D] -> [B, T, H * D] in gate's dtype."""
        b, t = gate.shape[:2]
        return (self.o_norm(o.float()) * F.silu(gate.float())).to(gate.dtype).reshape(b, t, -1)


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

    def forward(self, x, pending, positions, batch, cache):
        """x [B, T, hidden] and the previous layer's MLP branch `pending` (None in the first layer),
        added here so that the add and this layer's input norm are one kernel where fla has it
        -> (x, this layer's MLP branch)."""
        normed, x = add_norm(x, pending, self.input_norm)
        h = self.mixer(normed, positions, batch, cache)
        normed, x = add_norm(x, h if self.post_attn_norm is None else self.post_attn_norm(h), self.pre_mlp_norm)
        h = self.mlp(normed)
        return x, (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


def add_norm(x: torch.Tensor, h: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + h), x + h), or (norm(x), x) when h is None; one fla kernel for inference on CUDA."""
    if h is None:
        return norm(x), x
    if (x.is_cuda and not norm.unit_offset and not torch.is_grad_enabled()
            and x.dtype == h.dtype == norm.weight.dtype):
        fused = fla_op("rms_norm", h, norm.weight, None, residual=x, eps=norm.eps, prenorm=True)
        if fused is not None:
            return fused
    x = x + h
    return norm(x), x


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation != "silu":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        act = fla_op("swiglu", gate, up) if x.is_cuda and not torch.is_grad_enabled() else None
        return self.down_proj(act if act is not None else F.silu(gate) * up)


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
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, positions, batch, cache.layers[i] if cache is not None else None)
        if logits_to_keep:
            x, pending = x[:, -logits_to_keep:], pending[:, -logits_to_keep:]
        x, _ = add_norm(x, pending, self.norm)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ weight[: self.vocab_size].t()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
