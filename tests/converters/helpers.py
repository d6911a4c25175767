"""Shared builders for the converter tests: tiny architectures and random HybridLM state dicts."""
from __future__ import annotations

import torch

from megatron_tc.model.config import ArchConfig


def tiny_arch(pattern: str = "AGAG", **overrides) -> ArchConfig:
    """A tiny hybrid: hidden 64, 4 heads / 2 KV heads of 16, ffn 96, vocab 300 (not a multiple of 128)."""
    fields = dict(family="qwen3", vocab_size=300, hidden_size=64, num_layers=len(pattern.replace("|", "")),
                  num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, layer_pattern=pattern,
                  attention_bias=True, qk_norm=True, gdn_conv_size=4)
    fields.update(overrides)
    return ArchConfig(**fields)


def synthetic_state(arch: ArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the HybridLM names and shapes documented in megatron_tc.model.config."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    h, d, hid = arch.num_heads, arch.head_dim, arch.hidden_size
    state = {"embed_tokens.weight": rnd(arch.padded_vocab_size, hid), "norm.weight": rnd(hid)}
    if not arch.tie_embeddings:
        state["lm_head.weight"] = rnd(arch.padded_vocab_size, hid)
    for i, kind in enumerate(arch.layer_kinds):
        p = f"layers.{i}."
        norms = ["input_norm", "pre_mlp_norm"] + (["post_attn_norm", "post_mlp_norm"] if arch.sandwich_norm else [])
        state.update({f"{p}{n}.weight": rnd(hid) for n in norms})
        state.update({f"{p}mlp.gate_proj.weight": rnd(arch.intermediate_size, hid),
                      f"{p}mlp.up_proj.weight": rnd(arch.intermediate_size, hid),
                      f"{p}mlp.down_proj.weight": rnd(hid, arch.intermediate_size)})
        kv = arch.num_kv_heads if kind == "A" else arch.gdn_kv_heads
        m = p + "mixer."
        state.update({f"{m}q_proj.weight": rnd(h * d, hid), f"{m}k_proj.weight": rnd(kv * d, hid),
                      f"{m}v_proj.weight": rnd(kv * d, hid), f"{m}o_proj.weight": rnd(hid, h * d)})
        if arch.attention_bias:
            state.update({f"{m}q_proj.bias": rnd(h * d), f"{m}k_proj.bias": rnd(kv * d), f"{m}v_proj.bias": rnd(kv * d)})
        if kind == "A" and arch.qk_norm:
            state.update({f"{m}q_norm.weight": rnd(d), f"{m}k_norm.weight": rnd(d)})
        if kind == "G":
            state.update({f"{m}a_proj.weight": rnd(h, hid), f"{m}b_proj.weight": rnd(h, hid), f"{m}A_log": rnd(h),
                          f"{m}dt_bias": rnd(h), f"{m}g_proj.weight": rnd(h * d, hid), f"{m}o_norm.weight": rnd(d)})
            if arch.gdn_b_bias:
                state[f"{m}b_proj.bias"] = rnd(h)
            if arch.gdn_conv_size:
                for name, ch in (("q", h * d), ("k", kv * d), ("v", kv * d)):
                    state[f"{m}{name}_conv1d.weight"] = rnd(ch, 1, arch.gdn_conv_size)
    return state
