"""Rotary position embeddings: default, linear scaling and Llama-3 scaling (as Hugging Face)."""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, always computed on the CPU (the same bits on
    every device, and usable inside a `torch.device("meta")` context).

    scaling: None / {"rope_type": "default"}, {"rope_type": "linear", "factor"} or
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths / factor, short ones kept, smooth between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; `apply(x [B,H,T,D], position_ids [B,T])` rotates x.

    `inv_freq` [head_dim // 2] is a non-persistent fp32 buffer and stays fp32 whatever the module
    is cast to (`model.to(torch.bfloat16)`, `.half()`, a DeepSpeed bf16 engine): in bf16 the
    angle at position 32k would be off by tens of radians. Every `_apply` (cast, move,
    `to_empty`) recomputes it from the stored (head_dim, theta, scaling).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, float(theta)
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_buffers(torch.empty(0).device)  # the default device (a `with torch.device(...)` context)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute `inv_freq` in fp32 on `device` (default: where it is now); for models built
        on the meta device and then materialized (`to_empty`, transformers' loading)."""
        device = self.inv_freq.device if device is None else torch.device(device)
        if device.type == "meta":
            self.inv_freq = torch.empty(self.head_dim // 2, dtype=torch.float32, device=device)
        else:
            self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.reset_buffers()  # undo a dtype cast (or to_empty's garbage): always fp32, exact
        return self

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] for position_ids [B, T] (computed in fp32 like HF, then cast); inside
        `shared_tables()` made once for every layer with this RoPE (the same tensors)."""
        return self._shared("cos_sin", position_ids, dtype, self.make_tables)

    def rotation_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotate_by`'s tables: cos, and sin with its first half negated [B, 1, T, D] (shared as
        `cos_sin`'s are)."""
        return self._shared("rotation", position_ids, dtype, self._signed_tables)

    def _signed_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(position_ids, dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _shared(self, what: str, position_ids: torch.Tensor, dtype: torch.dtype, make) -> tuple[torch.Tensor, ...]:
        """make(position_ids, dtype), or inside `shared_tables()` the tables an earlier layer with
        this RoPE made. Traced code makes its own (it cannot read a ContextVar)."""
        tables = None if torch.compiler.is_compiling() else _TABLES.get()
        if tables is None:
            return make(position_ids, dtype)
        key = (what, id(position_ids), position_ids._version, dtype, self.head_dim, self.theta, repr(self.scaling))
        made = tables.get(key)
        if made is None or made[0] is not position_ids:
            # the entry holds position_ids itself, so no other tensor takes its id while it lives
            made = tables[key] = (position_ids, *make(position_ids, dtype))
        return made[1:]

    def make_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin`'s tables, computed."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device, torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] rotated by `cos_sin`'s tables: Hugging Face's formula."""
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def rotate_by(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] rotated by `rotation_tables`: `rotate`'s values bit for bit (x2 * -s is
        -x2 * s exactly), in 4 operators instead of 7 (a roll instead of two slices, a negation
        and a concatenation; each is a kernel launch in an eager forward on a GPU)."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


_TABLES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("megatron_tc_rope_tables", default=None)


def shared_tables() -> contextlib.AbstractContextManager:
    """Within: `RotaryEmbedding.cos_sin` and `rotation_tables` make the tables of given positions
    and dtype once per RoPE (head_dim, theta, scaling) and hand every later layer the same tensors,
    as Hugging Face models compute them once per forward (`HybridLM.forward` opens one: after the
    first, an attention layer issues none of the tables' operators, each a kernel launch on a GPU).
    Under torch.compile a plain context (the compiled code computes its own tables). The tables
    are dropped on exit."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _sharing()


@contextlib.contextmanager
def _sharing() -> Iterator[None]:
    token = _TABLES.set({})
    try:
        yield
    finally:
        _TABLES.reset(token)
