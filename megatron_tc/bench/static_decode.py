"""Greedy decoding of a `HybridLM` with fixed shapes and addresses, so a step can be captured
once in a CUDA graph and replayed for every later token (docs/inference-benchmarks.md: the
eager loop spends ~60 ms per step on the host against ~3.3 ms of GPU work).

What differs from the model's own decoding path (`model(token, cache=HybridCache)`):
- attention layers read and write preallocated KV buffers [B, Hkv, capacity, D]; the new key goes
  to slot `length` (a device tensor, not a Python int) and the query attends over all slots with a
  mask `slot <= length`, grouped heads by a reshape (no K/V copies, no SDPA planning per length);
- positions come from the device counter `length`, advanced inside the step;
- GDN layers run the model's own `DecoderLayer.forward` on a `GDNCache` whose tensors are
  static buffers; the new state (and conv inputs) are copied back into them at the end of the layer.
Cost of the mask: a step reads `capacity` KV slots, so choose capacity = context + new tokens.
Full attention only (no sliding windows); this is benchmark code, the model is unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_tc.model import HybridCache, HybridLM
from megatron_tc.model.attention import Attention
from megatron_tc.model.cache import AttentionCache, GDNCache
from megatron_tc.model.transformer import DecoderLayer


class StaticDecoder:
    """Decoding steps over static buffers filled from a prefilled `HybridCache`.

    decoder = StaticDecoder(model, cache, capacity); decoder.capture() (CUDA only);
    tokens = decoder.decode(token [B, 1], steps) -> the tokens after each step [B, steps].
    """

    def __init__(self, model: HybridLM, cache: HybridCache, capacity: int) -> None:
        arch = model.arch
        if any(arch.layer_type(i) == "sliding" for i, k in enumerate(arch.layer_kinds) if k == "A"):
            raise ValueError("StaticDecoder supports full attention only; this model has sliding-window layers")
        if cache.seen_tokens < 1 or cache.seen_tokens >= capacity:
            raise ValueError(f"capacity {capacity} must exceed the prefilled length {cache.seen_tokens} (>= 1)")
        self.model, self.capacity, self.seen = model, capacity, cache.seen_tokens
        self.graph: torch.cuda.CUDAGraph | None = None
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gdn: dict[int, GDNCache] = {}
        self.gdn_buffers: dict[int, dict[str, torch.Tensor]] = {}
        batch = None
        for i, entry in enumerate(cache.layers):
            if isinstance(entry, AttentionCache):
                k, v = entry.k, entry.v  # [B, Hkv, seen, D]
                batch = k.shape[0]
                bufs = [k.new_zeros(k.shape[0], k.shape[1], capacity, k.shape[3]) for _ in range(2)]
                bufs[0][:, :, : k.shape[2]], bufs[1][:, :, : k.shape[2]] = k, v
                self.kv[i] = (bufs[0], bufs[1])
            elif isinstance(entry, GDNCache):
                batch = entry.state.shape[0]
                buffers = {"state": entry.state.clone(), **{f"conv.{n}": t.clone() for n, t in entry.conv.items()}}
                self.gdn_buffers[i] = buffers
                self.gdn[i] = GDNCache()
            else:
                raise ValueError(f"layer {i} has no cache entry: prefill the cache before building a StaticDecoder")
        self.step_cache = HybridCache(arch)  # holds the GDN entries the layers read through cache.layer(i)
        for i, entry in self.gdn.items():
            self.step_cache.layers[i] = entry
        device = model.embed_tokens.weight.device
        self.length = torch.tensor(self.seen, dtype=torch.long, device=device)  # slot of the next token
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slots = torch.arange(capacity, device=device)

    # ---- one step ---------------------------------------------------------------------------
    def _attention(self, layer: DecoderLayer, index: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The mixer of attention layer `index` on x [B, 1, hidden] over the static KV buffers."""
        mixer: Attention = layer.mixer
        b = x.shape[0]
        q, k, v = mixer.project_qkv(x, positions)  # q [B, Hq, 1, D], k/v [B, Hkv, 1, D]
        k_buf, v_buf = self.kv[index]
        k_buf.index_copy_(2, self.length.view(1), k)
        v_buf.index_copy_(2, self.length.view(1), v)
        hkv, d = k_buf.shape[1], k_buf.shape[3]
        q = q.reshape(b, hkv, mixer.num_heads // hkv, d)  # query head h reads KV head h // group
        scores = (q @ k_buf.transpose(-1, -2)).float() * mixer.scale  # [B, Hkv, group, capacity]
        scores = scores.masked_fill(self.slots > self.length, float("-inf"))
        out = F.softmax(scores, dim=-1).to(v_buf.dtype) @ v_buf  # [B, Hkv, group, D]
        return mixer.o_proj(out.reshape(b, 1, mixer.num_heads * d))

    def _decoder_layer(self, layer: DecoderLayer, index: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if index in self.gdn:
            entry, buffers = self.gdn[index], self.gdn_buffers[index]
            entry.state = buffers["state"]
            entry.conv = {name[5:]: t for name, t in buffers.items() if name.startswith("conv.")}
            x = layer(x, positions, None, self.step_cache)
            buffers["state"].copy_(entry.state)
            for name, t in entry.conv.items():
                buffers[f"conv.{name}"].copy_(t)
            return x
        h = self._attention(layer, index, layer.input_norm(x), positions)  # as DecoderLayer.forward
        if layer.post_attn_norm is not None:
            h = layer.post_attn_norm(h)
        x = x + h
        h = layer.mlp(layer.pre_mlp_norm(x))
        if layer.post_mlp_norm is not None:
            h = layer.post_mlp_norm(h)
        return x + h

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Logits [B, 1, V] of `self.token` at position `length`; advances `length` on the device."""
        positions = self.length.view(1, 1).expand(self.token.shape[0], 1)
        x = self.model.embed(self.token)
        for i, layer in enumerate(self.model.layers):
            x = self._decoder_layer(layer, i, x, positions)
        logits = self.model.logits(self.model.norm(x))
        self.length.add_(1)
        return logits

    # ---- CUDA graph ---------------------------------------------------------------------------
    def _state(self) -> list[torch.Tensor]:
        return [self.length] + [t for bufs in self.gdn_buffers.values() for t in bufs.values()]

    def capture(self) -> None:
        """Capture `step` in a CUDA graph (after two warm-up steps on a side stream, undone)."""
        saved = [t.clone() for t in self._state()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self._state(), saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the buffers keep the restored state
            self.logits = self.step()

    @torch.no_grad()
    def decode(self, token: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy: token [B, 1] -> the next `steps` tokens [B, steps] (replays the graph if captured)."""
        if self.seen + steps > self.capacity:
            raise ValueError(f"{steps} steps after {self.seen} tokens exceed the capacity {self.capacity}")
        out = []
        for _ in range(steps):
            self.token.copy_(token)
            if self.graph is not None:
                self.graph.replay()
                logits = self.logits
            else:
                logits = self.step()
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        self.seen += steps
        return torch.cat(out, dim=1)
