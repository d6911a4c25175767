"""Layers of a megatron_tc hybrid student (torch only): Gated DeltaNet, MLP, decoder layer and the
whole stack (megatron_tc's `HybridLM` layout and parameter names); attention and the shared
blocks are in attention_megatron_tc.py.

Numerics follow megatron_tc's model op for op on CPU (GDN gates in fp32), so an export reproduces
the in-package logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention_megatron_tc import Attention, Batch, Packed, RMSNorm
from .cache_megatron_tc import GDNLayerCache, MegatronTCCache
from .configuration_megatron_tc import MegatronTCConfig
from .gated_delta_megatron_tc import (
    causal_conv, fla_op, fused_chunk_rule, fused_decode_step, fused_small_kernels, gated_delta_rule,
)

MAX_A_LOG, MIN_LOG_DECAY = 30.0, -1e4
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
        y, a, bb, gate = self.projections(x)
        if keep is not None:
            y = y * keep  # a pad position feeds zeros, exactly like the start of a sequence
        conv_inputs = None
        if self.conv_size > 0:
            y, conv_inputs = causal_conv(y, self.conv_weight(), past)
        q, k, v = self.activated_heads(y)
        recording = cache is not None and cache.recording
        scale = self.head_dim**-0.5
        if batch.valid is None and not recording and self.backend in ("auto", "fla"):
            # the decay computed inside fla's kernel: no gate operators here
            fused = fused_chunk_rule(q, k, v, a, bb, self.A_log, self.dt_bias, scale, state)
            if fused is not None:
                return self.finish(fused, gate, conv_inputs, batch, cache)
        g, beta = self.gates(a, bb)
        if batch.valid is not None:  # decay 1 and no write: the state passes a pad unchanged
            g, beta = g * batch.valid[..., None], beta * batch.valid[..., None]
            k, v = k * keep[..., None], v * keep[..., None]
        if recording:  # the cache keeps q/k/v conv inputs as one tensor
            cache.remember({"qkv": conv_inputs} if conv_inputs is not None else {}, k, v, g, beta)
        result = gated_delta_rule(q, k, v, g, beta, scale, state, self.chunk, self.backend)
        return self.finish(result, gate, conv_inputs, batch, cache)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q/k/v (concatenated, before the convolution) [B, T, C], a and b [B, T, H] and the output
        gate [B, T, H, D] of x [B, T, hidden], from one matmul over the six projections' weights."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        layers = (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj)
        biases = [lin.bias if lin.bias is not None else lin.out_features for lin in layers]
        bias = None if all(isinstance(p, int) for p in biases) else self.packed_bias.get(biases)
        y = F.linear(x, self.packed_proj.get([lin.weight for lin in layers]), bias)
        y, a, bb, gate = y.split([sum(self.qkv_channels), h, h, h * d], -1)
        return y, a, bb, gate.reshape(b, t, h, d)

    def finish(self, result: tuple[torch.Tensor, torch.Tensor], gate: torch.Tensor, conv_inputs: torch.Tensor | None,
               batch: Batch, cache: GDNLayerCache | None) -> torch.Tensor:
        """Keep the final state and the convolution's last inputs in `cache`; o_proj of the gated,
        normed output. result: (o [B, T, H, D], final state)."""
        o, final = result
        if cache is not None:
            tail = {} if conv_inputs is None else {"qkv": conv_tail(conv_inputs, self.conv_size - 1, batch.end)}
            cache.store(final, tail)
        return self.o_proj(self.gated_norm(o, gate))

    def decode_step(self, x: torch.Tensor, cache: GDNLayerCache) -> torch.Tensor:
        """x [B, 1, hidden] after a prefill: one matmul for q, k, v, a, b and the output gate, one
        convolution step, then (CUDA with fla) the fused recurrence and gated norm."""
        b, h, d = x.shape[0], self.heads, self.head_dim
        y, a, bb, gate = self.projections(x)
        tail = {}
        if self.conv_size > 0:
            y, inputs = causal_conv(y, self.conv_weight(), cache.conv["qkv"])
            tail["qkv"] = inputs[:, :, 1:]
        q, k, v = self.activated_heads(y)
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

    def activated_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, T, H, D] (k and v expanded to H heads) of SiLU(y), y [B, T, C] the q, k and v
        channels before the activation. With as many k/v heads as q heads and no gradient, one kernel
        writes the three as one contiguous [3, B, T, C / 3] tensor: fla's kernels, which take
        contiguous inputs, then copy none of them."""
        b, t, _ = y.shape
        if self.kv_heads == self.heads:
            heads = y.unflatten(-1, (3, self.heads, self.head_dim)).permute(2, 0, 1, 3, 4)
            if y.requires_grad:  # an out= operator has no gradient
                qkv = F.silu(heads).contiguous()
            else:
                qkv = torch.ops.aten.silu.out(heads, out=y.new_empty(heads.shape))
            return qkv.unbind(0)
        q, k, v = (z.reshape(b, t, -1, self.head_dim) for z in F.silu(y).split(self.qkv_channels, -1))
        group = self.heads // self.kv_heads
        return q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)

    def gates(self, a: torch.Tensor, bb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), fp32 [B, T, H]."""
        rate = self.A_log.float().clamp(max=MAX_A_LOG).exp()
        g = (-rate * F.softplus(a.float() + self.dt_bias.float())).clamp(min=MIN_LOG_DECAY)
        return g, torch.sigmoid(bb.float())

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) * SiLU(gate) in fp32, o and gate [B, T, H, D] -> [B, T, H * D] in gate's dtype;
        one fla kernel where that pays (`fused_small_kernels`)."""
        b, t = gate.shape[:2]
        if fused_small_kernels(o) and not self.o_norm.unit_offset and o.dtype == gate.dtype:
            fused = fla_op("gated_norm", o, gate, self.o_norm.weight, None, activation="swish", eps=self.o_norm.eps)
            if fused is not None:
                return fused.reshape(b, t, -1)
        return (self.o_norm(o.float()) * F.silu(gate.float())).to(gate.dtype).reshape(b, t, -1)


def conv_tail(inputs: torch.Tensor, width: int, end: torch.Tensor | None) -> torch.Tensor:
    """The last `width` convolution inputs [B, C, width] the cache keeps, of inputs [B, C, width + T]
    (the `width` before the forward first): the last ones, or with `end` ([1] long, the real tokens
    of a right-padded prompt) the `width` before position `end`."""
    if end is None:
        return inputs[:, :, inputs.shape[2] - width:]
    return inputs.index_select(2, end + torch.arange(width, device=inputs.device))


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
        added here so that the add and this layer's input norm are one fla kernel where that pays
        (`fused_small_kernels`) -> (x, this layer's MLP branch)."""
        normed, x = add_norm(x, pending, self.input_norm)
        h = self.mixer(normed, positions, batch, cache)
        normed, x = add_norm(x, h if self.post_attn_norm is None else self.post_attn_norm(h), self.pre_mlp_norm)
        h = self.mlp(normed)
        return x, (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


def add_norm(x: torch.Tensor, h: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + h), x + h), or (norm(x), x) when h is None; one fla kernel where that pays."""
    if h is None:
        return norm(x), x
    if fused_small_kernels(x) and not norm.unit_offset and x.dtype == h.dtype == norm.weight.dtype:
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
        act = fla_op("swiglu", gate, up) if fused_small_kernels(x) else None
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
                cache: MegatronTCCache | None, logits_to_keep: int = 0, run_layer=None) -> torch.Tensor:
        """Logits [B, T or logits_to_keep, vocab]. run_layer(i, layer, x, pending, layer cache) ->
        (x, pending), if given, runs each decoder layer in place of its own forward (a captured one)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        pending = None
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            if run_layer is None:
                x, pending = layer(x, pending, positions, batch, layer_cache)
            else:
                x, pending = run_layer(i, layer, x, pending, layer_cache)
        if logits_to_keep and batch.end is None:
            x, pending = x[:, -logits_to_keep:], pending[:, -logits_to_keep:]
        elif logits_to_keep:  # right padding: the last real tokens, wherever `end` puts them
            keep = batch.end - logits_to_keep + torch.arange(logits_to_keep, device=x.device)
            x, pending = x.index_select(1, keep), pending.index_select(1, keep)
        x, _ = add_norm(x, pending, self.norm)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ weight[: self.vocab_size].t()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
