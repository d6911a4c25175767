"""Decoding cache: KV for attention layers (a ring of the window on sliding layers), recurrent
state plus short-conv inputs for Gated DeltaNet layers (constant size per token)."""
from __future__ import annotations

import torch

from .config import ArchConfig


class AttentionCache:
    """Keys/values [B, Hkv, *, D] of one attention layer, written in place into preallocated buffers.

    Full layers: slot i holds position i; the buffers start at `max_length` slots when a hint is
    given (generate gives one), else at the first update's length, and double when full, so a
    decoding step copies only its own key instead of the whole cache.
    Sliding layers: a ring of `sliding_window` slots, position p in slot p % window; after a step
    at position p it holds p - window + 1 .. p, exactly what the query at p sees.
    """

    def __init__(self, sliding_window: int | None = None, max_length: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.max_length = max_length
        self._k: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: torch.Tensor | None = None
        self.seen = 0  # tokens processed so far

    # ---- what is kept --------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Number of valid slots."""
        return self.seen if self.sliding_window is None else min(self.seen, self.sliding_window)

    @property
    def k(self) -> torch.Tensor | None:
        """Kept keys [B, Hkv, kept, D] (ring order on sliding layers; see `index`)."""
        return None if self._k is None else self._k[:, :, : self.kept]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.kept]

    def index(self, device: torch.device | None = None) -> torch.Tensor:
        """Absolute sequence index [kept] of every kept slot."""
        device = device or (self._k.device if self._k is not None else None)
        slots = torch.arange(self.kept, device=device)
        if self.sliding_window is None:
            return slots
        last = self.seen - 1  # slot s holds the latest position p <= last with p % window == s
        return last - (last - slots) % self.sliding_window

    # ---- writing -------------------------------------------------------------------------
    def _allocate(self, like: torch.Tensor, capacity: int) -> None:
        """(Re)allocate both buffers with `capacity` slots, keeping what is stored."""
        b, h, _, d = like.shape
        new_k, new_v = like.new_empty(b, h, capacity, d), like.new_empty(b, h, capacity, d)
        if self._k is not None:
            n = min(self._k.shape[2], capacity)
            new_k[:, :, :n], new_v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
        self._k, self._v = new_k, new_v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new k, v [B, Hkv, T, D]; return the keys and values this step's queries may need
        and their absolute indices [Tk] (attention_mask hides the ones a query must not see;
        with T == 1 every returned key is visible)."""
        if self._k is not None and k.shape[:2] + k.shape[3:] != self._k.shape[:2] + self._k.shape[3:]:
            raise ValueError(f"cache holds [B, Hkv, *, D] = {list(self._k.shape)}, got keys {list(k.shape)}; "
                             "use HybridCache.reorder to change the batch")
        if self.sliding_window is None:
            return self._update_full(k, v)
        return self._update_ring(k, v)

    def _update_full(self, k: torch.Tensor, v: torch.Tensor):
        end = self.seen + k.shape[2]
        capacity = 0 if self._k is None else self._k.shape[2]
        if end > capacity:
            self._allocate(k, max(end, 2 * capacity, self.max_length or 0))
        self._k[:, :, self.seen : end], self._v[:, :, self.seen : end] = k, v
        self.seen = end
        return self._k[:, :, :end], self._v[:, :, :end], torch.arange(end, device=k.device)

    def _update_ring(self, k: torch.Tensor, v: torch.Tensor):
        window, t = self.sliding_window, k.shape[2]
        if self._k is None:
            self._allocate(k, window)
        if t == 1:  # decoding: overwrite the one key no later query sees, attend over the ring
            slot = self.seen % window
            self._k[:, :, slot], self._v[:, :, slot] = k[:, :, 0], v[:, :, 0]
            self.seen += 1
            return self.k, self.v, self.index(k.device)
        new_index = torch.arange(self.seen, self.seen + t, device=k.device)
        if self.kept:  # a chunk: previous keys (ring order) + the chunk, masked by index
            keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            index = torch.cat([self.index(k.device), new_index])
        else:
            keys, values, index = k, v, new_index
        last = min(t, window)
        slots = new_index[t - last :] % window
        self._k.index_copy_(2, slots, k[:, :, t - last :])
        self._v.index_copy_(2, slots, v[:, :, t - last :])
        self.seen += t
        return keys, values, index

    def snapshot(self) -> tuple:
        """State to `restore` later; undoes the steps in between, because a step writes only slots
        no query at or after the snapshot position reads (beyond `seen`, or the ring slot of
        position seen - window)."""
        return self._k, self._v, self.seen

    def restore(self, snapshot: tuple) -> None:
        self._k, self._v, self.seen = snapshot

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` [B'] (e.g. drop finished sequences)."""
        if self._k is not None:
            self._k, self._v = self._k[index], self._v[index]


class GDNCache:
    """Recurrent state [B, H, Dk, Dv] and the last conv_size - 1 inputs [B, C, K-1] per conv."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.seen = 0


class HybridCache:
    """One entry per layer, created on first use; `seen_tokens` counts tokens already processed."""

    def __init__(self, arch: ArchConfig, max_length: int | None = None) -> None:
        """max_length: the longest sequence expected (prompt + new tokens), a capacity hint for
        the KV buffers of full-attention layers (they grow past it when needed)."""
        self.arch = arch
        self.max_length = max_length
        self.layers: list[AttentionCache | GDNCache | None] = [None] * arch.num_layers
        self.seen_tokens = 0

    def layer(self, index: int) -> AttentionCache | GDNCache:
        if self.layers[index] is None:
            if self.arch.layer_kinds[index] == "A":
                sliding = self.arch.layer_type(index) == "sliding"
                window = self.arch.sliding_window if sliding else None
                self.layers[index] = AttentionCache(window, None if sliding else self.max_length)
            else:
                self.layers[index] = GDNCache()
        return self.layers[index]

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (e.g. to drop finished sequences): index [B']."""
        for entry in self.layers:
            if isinstance(entry, AttentionCache):
                entry.reorder(index)
            elif isinstance(entry, GDNCache):
                if entry.state is not None:
                    entry.state = entry.state[index]
                entry.conv = {name: s[index] for name, s in entry.conv.items()}
