"""Decoding cache: KV for attention layers (trimmed to the window on sliding layers), recurrent
state plus short-conv inputs for Gated DeltaNet layers (constant size per token)."""
from __future__ import annotations

import torch

from .config import ArchConfig


class AttentionCache:
    """Keys/values [B, Hkv, Tc, D] of one attention layer and their absolute sequence indices."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.seen = 0  # tokens processed so far

    @property
    def start(self) -> int:
        """Absolute index of the first kept key."""
        return self.seen - (0 if self.k is None else self.k.shape[2])

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append new k, v [B, Hkv, T, D]; return all keys, values for this step and their indices [Tk].

        Sliding layers keep only the last `window - 1` keys afterwards: the next query can see
        no older key.
        """
        start = self.start
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        index = torch.arange(start, start + k.shape[2], device=k.device)
        self.seen = start + k.shape[2]
        keep = k.shape[2] if self.sliding_window is None else min(k.shape[2], self.sliding_window - 1)
        self.k, self.v = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        return k, v, index


class GDNCache:
    """Recurrent state [B, H, Dk, Dv] and the last conv_size - 1 inputs [B, C, K-1] per conv."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.seen = 0


class HybridCache:
    """One entry per layer, created on first use; `seen_tokens` counts tokens already processed."""

    def __init__(self, arch: ArchConfig) -> None:
        self.arch = arch
        self.layers: list[AttentionCache | GDNCache | None] = [None] * arch.num_layers
        self.seen_tokens = 0

    def layer(self, index: int) -> AttentionCache | GDNCache:
        if self.layers[index] is None:
            if self.arch.layer_kinds[index] == "A":
                sliding = self.arch.layer_type(index) == "sliding"
                self.layers[index] = AttentionCache(self.arch.sliding_window if sliding else None)
            else:
                self.layers[index] = GDNCache()
        return self.layers[index]

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (e.g. to drop finished sequences): index [B']."""
        for entry in self.layers:
            if isinstance(entry, AttentionCache) and entry.k is not None:
                entry.k, entry.v = entry.k[index], entry.v[index]
            elif isinstance(entry, GDNCache):
                if entry.state is not None:
                    entry.state = entry.state[index]
                entry.conv = {name: s[index] for name, s in entry.conv.items()}
