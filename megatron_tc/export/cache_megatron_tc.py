"""The decoding cache of an exported student, a `transformers.Cache` (torch and transformers only).

Attention layers keep keys/values [B, Hkv, L, D]: concatenated as they come (dynamic), or in
buffers of `static_len` slots written in place (static: fixed addresses, so a decoding step can
be captured in a CUDA graph). Gated DeltaNet layers keep the recurrent state [B, H, Dk, Dv] (fp32)
and the last K-1 inputs of the short convolution over the q, k and v channels (one tensor,
"qkv" [B, C, K-1]).

Everything `generate` needs is implemented here rather than inherited, so it behaves the same on
every supported transformers release: beam search (`reorder_cache`), expansion and selection of
rows, and `crop` for assisted decoding. A recurrent state cannot be cut back by slicing, so while
past recording is on (`activate_past_recording`, which assisted decoding calls), each GDN layer
keeps the state before its last forward and that forward's inputs, and `crop` recomputes the
state over the tokens that are kept.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .gated_delta_megatron_tc import gated_delta_rule


class AttentionLayerCache:
    """Keys and values of one attention layer; `static_len` slots in place, or grown by concatenation."""

    def __init__(self, static_len: int | None = None) -> None:
        self.static_len = static_len
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, offset: int, slots: torch.Tensor | None,
               kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at positions offset.. (slots [T] on the device for static buffers);
        return the first `kv_len` keys and values (all slots when kv_len is None)."""
        if self.static_len is None:
            if self.keys is None or offset == 0:
                self.keys, self.values = k, v
            else:
                self.keys = torch.cat([self.keys[:, :, :offset], k], 2)
                self.values = torch.cat([self.values[:, :, :offset], v], 2)
            return self.keys, self.values
        shape = (k.shape[0], k.shape[1], self.static_len, k.shape[3])
        if self.keys is None or offset == 0 and (self.keys.shape, self.keys.dtype) != (shape, k.dtype):
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        if offset + k.shape[2] > self.static_len:
            raise ValueError(f"the static cache holds {self.static_len} tokens; {offset + k.shape[2]} do not fit "
                             "(generate fewer tokens, or pass MegatronTCCache(config, static_len=N) with a larger N)")
        self.keys.index_copy_(2, slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, slots, v.to(self.values.dtype))
        if kv_len is None:
            return self.keys, self.values
        return self.keys[:, :, :kv_len], self.values[:, :, :kv_len]

    def crop(self, keep: int) -> None:
        if self.static_len is None and self.keys is not None:
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.keys is None else {"keys": self.keys, "values": self.values}


class GDNLayerCache:
    """Recurrent state and short-convolution inputs of one Gated DeltaNet layer."""

    def __init__(self, static: bool = False) -> None:
        self.static = static
        self.state: torch.Tensor | None = None  # [B, H, Dk, Dv] fp32
        self.conv: dict[str, torch.Tensor] = {}  # name -> [B, C, K-1]
        self.recording = False
        self.record: dict[str, Any] | None = None

    def store(self, state: torch.Tensor, conv: dict[str, torch.Tensor]) -> None:
        """Keep the state after a forward; static caches copy into their buffers (same addresses)."""
        same = all(n in self.conv and (self.conv[n].shape, self.conv[n].dtype) == (x.shape, x.dtype)
                   for n, x in conv.items())
        if self.static and self.state is not None and self.state.shape == state.shape and same:
            self.state.copy_(state)
            for name, x in conv.items():
                self.conv[name].copy_(x)
        else:
            self.state = state.clone() if self.static else state
            self.conv = {name: x.clone() if self.static else x for name, x in conv.items()}

    def remember(self, conv_inputs: dict[str, torch.Tensor], k, v, g, beta) -> None:
        """While recording: the state before this forward and its inputs, for `crop`."""
        if self.recording:
            before = None if self.state is None else self.state.clone()
            self.record = {"state": before, "conv_inputs": conv_inputs, "k": k, "v": v, "g": g, "beta": beta}

    def crop(self, remove: int, scale: float, chunk: int) -> None:
        """Undo the last `remove` tokens of the last forward (needs a record of it)."""
        if remove == 0:
            return
        rec = self.record
        t = 0 if rec is None else rec["k"].shape[1]
        if rec is None or remove > t:
            raise ValueError(f"cannot crop {remove} tokens from a Gated DeltaNet state: only the last forward's "
                             f"{t} tokens can be undone, and only while past recording is active")
        keep = t - remove
        k, v, g, beta = (rec[n][:, :keep] for n in ("k", "v", "g", "beta"))
        if keep:
            _, state = gated_delta_rule(k, k, v, g, beta, scale, rec["state"], chunk, backend="auto")
        else:
            state = rec["state"] if rec["state"] is not None else torch.zeros_like(self.state)
        width = next(iter(rec["conv_inputs"].values())).shape[2] - t if rec["conv_inputs"] else 0
        conv = {n: x[:, :, keep:keep + width] for n, x in rec["conv_inputs"].items()}
        self.store(state.to(self.state.dtype), conv)
        self.record = {"state": rec["state"], "k": k, "v": v, "g": g, "beta": beta,
                       "conv_inputs": {n: x[:, :, :width + keep] for n, x in rec["conv_inputs"].items()}}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {} if self.state is None else {"state": self.state}
        out.update({f"conv.{n}": x for n, x in self.conv.items()})
        return out


class MegatronTCCache(Cache):
    """KV + recurrent cache of a hybrid student. `static_len` makes attention buffers static.

    seen: tokens processed so far (python int); the model advances it after each forward."""

    def __init__(self, config: Any, static_len: int | None = None) -> None:
        # Cache.__init__ differs between transformers releases; set what its methods read ourselves.
        self.pattern = config.arch_value("layer_pattern").replace("|", "") or "A" * config.num_hidden_layers
        self.static_len = static_len
        self.layers = [AttentionLayerCache(static_len) if kind == "A" else GDNLayerCache(static_len is not None)
                       for kind in self.pattern]
        self.layer_class_to_replicate = None
        self.offloading = False
        self.seen = 0
        self.gdn_scale = config.head_dim**-0.5
        self.gdn_chunk = config.arch_value("gdn_chunk_size")

    def __repr__(self) -> str:
        return f"MegatronTCCache(pattern={self.pattern!r}, seen={self.seen}, static={self.static_len})"

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_static(self) -> bool:
        return self.static_len is not None

    # ---- lengths ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.static_len is None else self.static_len

    def get_max_cache_shape(self, layer_idx: int | None = None) -> int:
        return self.get_max_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False  # the model captures its own decoding step (see MegatronTCForCausalLM)

    @property
    def is_initialized(self) -> bool:
        return self.seen > 0

    @property
    def is_croppable(self) -> bool:
        return all(not isinstance(layer, GDNLayerCache) or layer.recording for layer in self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, GDNLayerCache) for layer in self.layers]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def batch_size(self) -> int:
        sizes = [t.shape[0] for layer in self.layers for t in layer.tensors().values()]
        return sizes[0] if sizes else -1

    # ---- editing ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache. A static cache keeps its buffers (zeroed in place, same addresses), so
        a captured decoding step over it stays valid for the next generation."""
        for i, kind in enumerate(self.pattern):
            layer = self.layers[i]
            if self.is_static and not getattr(layer, "recording", False):
                for x in layer.tensors().values():
                    x.zero_()
                if isinstance(layer, GDNLayerCache):
                    layer.record = None
                continue
            self.layers[i] = AttentionLayerCache(self.static_len) if kind == "A" else GDNLayerCache(self.is_static)
        self.seen = 0

    def _rows(self, fn) -> None:
        """Apply fn to every cached tensor along the batch (static buffers keep their address when
        the batch size does not change)."""
        for layer in self.layers:
            for name, x in layer.tensors().items():
                new = fn(x)
                if self.is_static and new.shape == x.shape:
                    x.copy_(new)
                    continue
                if name.startswith("conv."):
                    layer.conv[name[5:]] = new
                else:
                    setattr(layer, name, new)
            if isinstance(layer, GDNLayerCache):
                layer.record = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i takes the state of row beam_idx[i]."""
        self._rows(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda x: x[indices.to(x.device)])

    def crop(self, tokens_to_remove: int) -> None:
        """Negative (or zero): drop that many of the last tokens; positive: keep that many tokens."""
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(self.seen - tokens_to_remove, 0)
        if remove == 0:
            return
        keep = self.seen - remove
        for layer in self.layers:
            if isinstance(layer, GDNLayerCache):
                layer.crop(remove, self.gdn_scale, self.gdn_chunk)
            else:
                layer.crop(keep)
        self.seen = keep

    def activate_past_recording(self) -> None:
        for layer in self.layers:
            if isinstance(layer, GDNLayerCache):
                layer.recording = True

    def deactivate_past_recording(self) -> None:
        for layer in self.layers:
            if isinstance(layer, GDNLayerCache):
                layer.recording, layer.record = False, None

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return any(getattr(layer, "recording", False) for layer in self.layers)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.seen > 0
