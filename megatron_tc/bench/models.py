"""Model presets, the hybrid layer pattern, FLOP counts and cache sizes used by the benchmarks.

FLOP counts (multiply-add = 2 FLOPs; embedding lookups count 0; norms, activations and
element-wise work are left out, as in the usual MFU convention):

  matmul parameters N     q/k/v/o (attention) or q/k/v/a/b/g/o (GDN) projections, MLP, LM head
                          over the real vocabulary (tied or not), per layer kind of the pattern
  forward, per token      2 N  +  sum over layers of the mixer term:
     attention (causal)   4 H D * (T + 1) / 2      QK^T and PV over the (T+1)/2 keys a query sees
     attention (decode)   4 H D * T                one query against T cached keys
     GDN chunked (C = 64) H * (8 C D + 6 D^2)      per chunk: kk^T, UT solve, qk^T, (qk)V' over C^2,
                                                   W S, q S, k^T V' over C D^2 (Dk = Dv = D)
     GDN recurrent        6 H D^2                  k^T S, the rank-1 update and q S per token
  training step           3 x forward of the student (backward = 2 x forward) + 1 x teacher forward
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_tc.model import ArchConfig, HybridCache
from megatron_tc.model.cache import AttentionCache, GDNCache


# ---- presets ----------------------------------------------------------------------------------
def smollm2_135m() -> ArchConfig:
    """SmolLM2-135M (the GGUF teacher's shape): 30 layers, hidden 576, 9 heads, 3 KV heads, tied."""
    return ArchConfig(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=1536, tie_embeddings=True, rope_theta=100000.0,
                      norm_eps=1e-5, max_position_embeddings=8192)


def llama_1b() -> ArchConfig:
    """A ~1.1B Llama-style configuration: hidden 2048, 16 layers, 16 heads x 128, 4 KV heads (the
    KV bytes per token of Llama-3.2-1B's 8 x 64), intermediate 8192, vocab 32000, untied.

    head_dim 128 with 16 heads is chosen so the GDN kernels share their compiled and autotuned
    shape (H=16, D=128) with tools/bench/gdn.py: fla compiles for a minute per new shape."""
    return ArchConfig(family="llama", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
                      num_kv_heads=4, head_dim=128, intermediate_size=8192, rope_theta=500000.0,
                      norm_eps=1e-5, max_position_embeddings=131072)


def tiny() -> ArchConfig:
    """CPU --quick runs: 4 layers, hidden 64."""
    return ArchConfig(family="llama", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, tie_embeddings=True)


def llama3_8b(num_layers: int = 32) -> ArchConfig:
    """Llama-3-8B's shape (hidden 4096, 32 heads x 128, 8 KV heads, FFN 14336, vocabulary 128256,
    untied); fewer layers for a model that must fit one device with its optimizer state."""
    return ArchConfig(family="llama", vocab_size=128256, hidden_size=4096, num_layers=num_layers, num_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500000.0, norm_eps=1e-5,
                      max_position_embeddings=8192)


def llama3_70b() -> ArchConfig:
    """Llama-3-70B's shape: 80 layers, hidden 8192, 64 heads x 128, 8 KV heads, FFN 28672."""
    return ArchConfig(family="llama", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                      num_kv_heads=8, head_dim=128, intermediate_size=28672, rope_theta=500000.0, norm_eps=1e-5,
                      max_position_embeddings=8192)


PRESETS = {"smollm2-135m": smollm2_135m, "llama-1b": llama_1b, "tiny": tiny, "llama3-8b": llama3_8b,
           "llama3-8b-8l": lambda: llama3_8b(8), "llama3-70b": llama3_70b}


def quarter_pattern(num_layers: int) -> str:
    """A quarter of the layers kept as attention, spread by the pipeline's `uniform` policy."""
    from megatron_tc.calibrate.policies import uniform

    keep = set(uniform(num_layers, max(1, round(num_layers / 4))).keep)
    return "".join("A" if i in keep else "G" for i in range(num_layers))


# ---- FLOPs ------------------------------------------------------------------------------------
def layer_matmul_params(arch: ArchConfig, kind: str) -> int:
    h, d, hid = arch.num_heads, arch.head_dim, arch.hidden_size
    mlp = 3 * hid * arch.intermediate_size
    if kind == "A":
        return hid * h * d * 2 + 2 * hid * arch.num_kv_heads * d + mlp
    return hid * h * d * 3 + 2 * hid * arch.gdn_kv_heads * d + 2 * hid * h + mlp


def matmul_params(arch: ArchConfig, trainable: str = "all") -> int:
    """N of the FLOP formula: projections + MLP + LM head ('all'); only GDN mixers ('gdn')."""
    if trainable == "gdn":
        h, d, hid = arch.num_heads, arch.head_dim, arch.hidden_size
        per = hid * h * d * 3 + 2 * hid * arch.gdn_kv_heads * d + 2 * hid * h
        return per * arch.layer_kinds.count("G")
    return sum(layer_matmul_params(arch, k) for k in arch.layer_kinds) + arch.vocab_size * arch.hidden_size


def mixer_flops_per_token(arch: ArchConfig, kind: str, context: int, decode: bool = False) -> float:
    h, d = arch.num_heads, arch.head_dim
    if kind == "A":
        keys = context if decode else (context + 1) / 2
        if arch.sliding_window:
            keys = min(keys, arch.sliding_window)
        return 4.0 * h * d * keys
    if decode:
        return 6.0 * h * d * d
    return h * (8.0 * arch.gdn_chunk_size * d + 6.0 * d * d)


def forward_flops(arch: ArchConfig, tokens: int, context: int, decode: bool = False) -> float:
    """Forward FLOPs over `tokens` tokens, each seeing `context` positions (see the module doc)."""
    mixers = sum(mixer_flops_per_token(arch, k, context, decode) for k in arch.layer_kinds)
    return tokens * (2.0 * matmul_params(arch) + mixers)


# ---- memory -----------------------------------------------------------------------------------
def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(cache: HybridCache) -> dict[str, int]:
    """Logical bytes of a decoding cache: attention KV and GDN recurrent state (+ conv inputs)."""
    kv = state = 0
    for entry in cache.layers:
        if isinstance(entry, AttentionCache) and entry.k is not None:
            kv += entry.k.numel() * entry.k.element_size() + entry.v.numel() * entry.v.element_size()
        elif isinstance(entry, GDNCache):
            if entry.state is not None:
                state += entry.state.numel() * entry.state.element_size()
            state += sum(t.numel() * t.element_size() for t in entry.conv.values())
    return {"kv_bytes": kv, "state_bytes": state, "total_bytes": kv + state}


def load_gguf_teacher(path: str) -> tuple[Any, str]:
    """(HybridLM fp32 on CPU, weights sha256) from a GGUF file through the calibrate loader."""
    from megatron_tc.calibrate.teacher_io import load_teacher

    teacher = load_teacher(path)
    return teacher.model, teacher.sha256


def copy_shared_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every tensor whose name and shape match (teacher -> hybrid student); returns the count."""
    theirs = src.state_dict()
    mine = dst.state_dict()
    same = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    dst.load_state_dict(same, strict=False)
    return len(same)
