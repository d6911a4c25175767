"""Softmax attention of the teacher families (Llama, Qwen2, Mistral, Qwen3, Gemma3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cache import AttentionCache
from .config import ArchConfig
from .norm import RMSNorm
from .ops.masks import attention_mask
from .rope import RotaryEmbedding

DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    """GQA attention with optional q/k/v bias, q/k RMSNorm, RoPE variants and sliding windows.

    Sliding layers of Gemma3 use `rope_local_theta` without scaling; every other layer uses
    `rope_theta` with `rope_scaling`.
    """

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.scale = arch.scale
        sliding = arch.layer_type(layer_idx) == "sliding"
        self.sliding_window = arch.sliding_window if sliding else None
        hq, hkv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.q_proj = nn.Linear(arch.hidden_size, hq, bias=arch.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, hkv, bias=arch.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, hkv, bias=arch.attention_bias)
        self.o_proj = nn.Linear(hq, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.norm_eps, arch.norm_unit_offset)
            self.k_norm = RMSNorm(arch.head_dim, arch.norm_eps, arch.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        local = sliding and arch.rope_local_theta is not None
        theta = arch.rope_local_theta if local else arch.rope_theta
        self.rope = RotaryEmbedding(arch.head_dim, theta, None if local else arch.rope_scaling)

    def project_qkv(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden], position_ids [B, T] -> q [B, Hq, T, D], k, v [B, Hkv, T, D].

        q and k are after q/k norm and RoPE (what the softmax sees, before the scale).
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, signed_sin = self.rope.rotation_tables(position_ids, q.dtype)
        return self.rope.rotate_by(q, cos, signed_sin), self.rope.rotate_by(k, cos, signed_sin), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_index: torch.Tensor | None,
        k_index: torch.Tensor | None,
        doc_ids: torch.Tensor | None = None,
        all_visible: bool = False,
    ) -> torch.Tensor:
        """SDPA over q [B,Hq,Tq,D], k/v [B,Hkv,Tk,D] -> [B,Hq,Tq,D]; indices are absolute positions
        (None: 0..T-1 for queries and keys alike, made only where a mask needs them).

        all_visible: every query may see every key (one decoding step over the cache), no mask.
        """
        if all_visible and doc_ids is None:
            return self._sdpa(q, k, v, None, is_causal=False)
        if doc_ids is None and self.sliding_window is None and q.shape[2] == k.shape[2]:
            return self._sdpa(q, k, v, None, is_causal=True)
        if q_index is None:
            q_index = k_index = torch.arange(q.shape[2], device=q.device)
        mask = attention_mask(q_index, k_index, self.sliding_window, doc_ids, doc_ids)
        return self._sdpa(q, k, v, mask, is_causal=False)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor:
        """GQA through SDPA's enable_gqa (no copy of K/V per query head) wherever the kernel SDPA
        would pick reads grouped heads: on CUDA that is flash attention (fp16/bf16, no mask), so
        other CUDA calls keep the explicit repeat (else SDPA may fall back to its O(T^2) math path)."""
        group = self.num_heads // self.num_kv_heads
        flash_ok = mask is None and q.dtype in (torch.float16, torch.bfloat16)
        if group > 1 and q.is_cuda and not flash_ok:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            group = 1
        if q.is_cuda and q.shape[2] == 1:
            # One-query decoding step: cuDNN's attention builds a plan per new KV length, 3 ms of host
            # time per call on an H200 (docs/inference-benchmarks.md); flash / efficient have none.
            with sdpa_kernel(DECODE_SDPA_BACKENDS):
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=group > 1
                )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=group > 1
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]. doc_ids [B, T] masks across packed documents."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, position_ids)
        if cache is not None:
            if doc_ids is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a decoding cache")
            q_index = torch.arange(cache.seen, cache.seen + t, device=x.device)
            k, v, k_index = cache.update(k, v)
        else:
            q_index = k_index = None  # positions 0..T-1, made by `attend` where a mask needs them
        out = self.attend(q, k, v, q_index, k_index, doc_ids, all_visible=cache is not None and t == 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
