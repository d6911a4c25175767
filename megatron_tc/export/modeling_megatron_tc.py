"""A megatron_tc hybrid student as a transformers causal LM (torch and transformers only).

Softmax-attention layers ('A') and Gated DeltaNet layers ('G') follow `config.arch`; state-dict
names are megatron_tc's `HybridLM` names under `model.`. An exported student directory carries
this file verbatim, so it loads with `trust_remote_code=True` where megatron_tc is not installed,
on transformers 5.17 to 5.24. `generate()` works in every mode (greedy, sampling, beam search,
assisted decoding, left-padded batches) through `MegatronTCCache`. Padding is exact: a pad
position is hidden from attention and leaves the GDN state and the convolution inputs unchanged.

Decoding on CUDA with a static cache (`generate(..., cache_implementation="static")`, the
default there) captures one decoding step in a CUDA graph and replays it for every later token.
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_megatron_tc import AttentionLayerCache, GDNLayerCache, MegatronTCCache
from .configuration_megatron_tc import MegatronTCConfig
from .gated_delta_megatron_tc import causal_conv, gated_delta_rule

# transformers 5.24 renamed `past_key_values` to `cache` (model kwargs and outputs)
CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
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
        rate = self.A_log.float().clamp(max=MAX_A_LOG).exp()
        g = (-rate * F.softplus(a.float() + self.dt_bias.float())).clamp(min=MIN_LOG_DECAY)
        beta = torch.sigmoid(bb.float())
        if batch.valid is not None:  # decay 1 and no write: the state passes a pad unchanged
            g, beta = g * batch.valid[..., None], beta * batch.valid[..., None]
            k, v = k * keep[..., None], v * keep[..., None]
        state = cache.state if cache is not None and batch.offset > 0 else None
        if cache is not None:
            cache.remember(conv_inputs, k, v, g, beta)
        o, final = gated_delta_rule(q, k, v, g, beta, self.head_dim**-0.5, state, self.chunk, self.backend)
        if cache is not None:
            width = self.conv_size - 1
            cache.store(final, {n: c[:, :, c.shape[2] - width:] for n, c in conv_inputs.items()})
        normed = self.o_norm(o.float())
        o = (normed * F.silu(self.g_proj(x).float()).view(normed.shape)).to(x.dtype)
        return self.o_proj(o.reshape(b, t, self.heads * self.head_dim))


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


class MegatronTCPreTrainedModel(PreTrainedModel):
    config_class = MegatronTCConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the checkpoint; only the RoPE tables (non-persistent buffers, left
        empty by transformers' meta-device loading) are recomputed here."""
        if isinstance(module, Rotary):
            module.reset()


class MegatronTCForCausalLM(MegatronTCPreTrainedModel, GenerationMixin):
    """forward(input_ids [B, T], attention_mask [B, cached + T]) -> logits [B, T, vocab]."""

    def __init__(self, config: MegatronTCConfig) -> None:
        super().__init__(config)
        self.model = HybridModel(config)
        self.decode_graphs = True  # capture the decoding step on CUDA with a static cache
        self._graph: DecodeGraph | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.lm_head  # None when tied: the embedding is reused

    def set_gdn_backend(self, backend: str) -> None:
        """'auto', 'fla', 'chunk' or 'recurrent' for every Gated DeltaNet layer."""
        for layer in self.model.layers:
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.backend = backend

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Any = None, cache: Any = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs: Any):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("MegatronTCForCausalLM takes input_ids [B, T], not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, MegatronTCCache):
            raise TypeError(f"the cache must be a MegatronTCCache (KV + recurrent state), got {type(cache).__name__}; "
                            "let generate() create it, or pass MegatronTCCache(model.config)")
        cache = (cache if cache is not None else MegatronTCCache(self.config)) if use_cache else None
        offset, (b, t) = (cache.seen if cache is not None else 0), input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (b, offset + t):
            raise ValueError(f"attention_mask must be [B, cached + new tokens] = {[b, offset + t]}, got "
                             f"{list(attention_mask.shape)} (a 2D mask of ones and zeros; zeros mark padding)")
        if self._can_replay(cache, input_ids, position_ids, labels):
            logits = self._graph_step(input_ids, attention_mask, cache)
        else:
            logits = self._eager(input_ids, attention_mask, position_ids, cache, offset, logits_to_keep)
        if cache is not None:
            cache.seen += t
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KEY: cache})

    def _eager(self, input_ids, attention_mask, position_ids, cache, offset, logits_to_keep):
        t, device = input_ids.shape[1], input_ids.device
        padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None:
            if padded:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = torch.arange(offset, offset + t, device=device).expand(input_ids.shape)
        valid = attention_mask[:, -t:].bool() if padded else None
        batch = Batch(offset, torch.arange(offset, offset + t, device=device), valid,
                      attention_mask.bool() if padded else None, offset + t)
        return self.model(input_ids, position_ids, batch, cache, logits_to_keep)

    # ---- captured decoding step -------------------------------------------------------------
    def _can_replay(self, cache, input_ids, position_ids, labels) -> bool:
        return (self.decode_graphs and cache is not None and cache.is_static and input_ids.is_cuda
                and input_ids.shape[1] == 1 and cache.seen > 0 and position_ids is None and labels is None
                and not torch.is_grad_enabled() and not cache.is_recording_past()
                and not torch.cuda.is_current_stream_capturing())

    def _graph_step(self, input_ids, attention_mask, cache) -> torch.Tensor:
        if cache.seen + 1 > cache.static_len:
            raise ValueError(f"the static cache holds {cache.static_len} tokens; pass a larger MegatronTCCache(config, static_len=N)")
        graph = self._graph
        if graph is None or not graph.fits(cache, input_ids):
            self._graph = None
            try:
                graph = self._graph = DecodeGraph(self, cache, input_ids, attention_mask)
            except Exception as exc:  # noqa: BLE001 - decoding stays correct, only slower
                warnings.warn(f"capturing the decoding step failed ({type(exc).__name__}: {str(exc)[:200]}); "
                              "decoding eagerly", RuntimeWarning, stacklevel=3)
                self.decode_graphs = False
                return self._eager(input_ids, attention_mask, None, cache, cache.seen, 0)
        return graph.replay(input_ids, attention_mask, cache.seen)

    # ---- generate ---------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args: Any, **kwargs: Any) -> None:
        """Our cache for generate: static (fixed addresses, captured decoding) on CUDA or when
        cache_implementation="static", else dynamic; max length from generate's arguments."""
        given = model_kwargs.get(CACHE_KEY)
        if given is not None:
            if not isinstance(given, MegatronTCCache):
                raise TypeError(f"the cache must be a MegatronTCCache, got {type(given).__name__}")
            return
        if generation_config.use_cache is False:
            return
        impl = generation_config.cache_implementation
        if impl not in (None, "dynamic", "static"):
            raise ValueError(f"cache_implementation={impl!r} is not supported by this model; use 'static' or 'dynamic'")
        max_len = args[2] if len(args) >= 3 else kwargs.get("max_cache_length")
        static = impl == "static" or (impl is None and self.device.type == "cuda")
        cache = MegatronTCCache(self.config, static_len=int(max_len) + 1 if static and max_len else None)
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
        model_kwargs[CACHE_KEY] = cache

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        """The tokens the cache has not seen yet, the whole 2D attention mask and the cache."""
        cache = kwargs.get(CACHE_KEY, kwargs.get("past_key_values"))
        seen = cache.seen if cache is not None else 0
        if seen >= input_ids.shape[1]:
            raise ValueError(f"the cache already holds {seen} tokens of this {input_ids.shape[1]}-token input")
        inputs = {"input_ids": input_ids[:, seen:].contiguous(), "attention_mask": attention_mask, CACHE_KEY: cache,
                  "use_cache": kwargs.get("use_cache", True)}
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs


class DecodeGraph:
    """One decoding step (B rows, one token each) over a static cache, captured in a CUDA graph.

    Inputs are copied into fixed buffers (token, position, cache slot, key mask) before each
    replay; the attention layers attend over every slot of the static buffers, hidden by the mask
    where a slot is in the future or padding."""

    def __init__(self, model: MegatronTCForCausalLM, cache: MegatronTCCache, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> None:
        device, b = input_ids.device, input_ids.shape[0]
        self.cache, self.pointers = cache, self._pointers(cache)
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(b, cache.static_len, dtype=torch.bool, device=device)
        self.stage(input_ids, attention_mask, cache.seen)
        batch = Batch(cache.seen, self.slots, None, self.key_valid, None)
        saved = {id(x): x.clone() for layer in cache.layers if isinstance(layer, GDNLayerCache)
                 for x in layer.tensors().values()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled and autotuned outside the capture
            model.model(self.ids, self.positions, batch, cache)
        torch.cuda.current_stream().wait_stream(stream)
        for layer in cache.layers:  # the warm-up advanced the GDN states: put them back
            if isinstance(layer, GDNLayerCache):
                for x in layer.tensors().values():
                    x.copy_(saved[id(x)])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.model(self.ids, self.positions, batch, cache)

    @staticmethod
    def _pointers(cache: MegatronTCCache) -> list[int]:
        return [x.data_ptr() for layer in cache.layers for x in layer.tensors().values()]

    def fits(self, cache: MegatronTCCache, input_ids: torch.Tensor) -> bool:
        return cache is self.cache and input_ids.shape[0] == self.ids.shape[0] and self._pointers(cache) == self.pointers

    def stage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seen: int) -> None:
        self.ids.copy_(input_ids)
        self.slots.fill_(seen)
        self.key_valid[:, seen + 1:] = False
        if attention_mask is None:
            self.key_valid[:, : seen + 1] = True
            self.positions.fill_(seen)
        else:
            self.key_valid[:, : seen + 1] = attention_mask.bool()
            self.positions.copy_(attention_mask.long().sum(-1, keepdim=True) - 1)

    def replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seen: int) -> torch.Tensor:
        self.stage(input_ids, attention_mask, seen)
        self.graph.replay()
        return self.logits.clone()
