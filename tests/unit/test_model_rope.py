"""RoPE tables stay fp32 (and exact) whatever the model is cast or moved to."""
from __future__ import annotations

import torch

from megatron_tc.model import ArchConfig, HybridLM
from megatron_tc.model.rope import RotaryEmbedding, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def tiny(**overrides) -> HybridLM:
    arch = dict(family="llama", vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16, intermediate_size=32, layer_pattern="AA", rope_theta=500000.0, rope_scaling=LLAMA3)
    arch.update(overrides)
    return HybridLM(ArchConfig(**arch))


def angles(rope: RotaryEmbedding, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(torch.tensor([[position]]), torch.float32)


def test_bf16_model_keeps_fp32_rope_angles_at_32k():
    model = tiny()
    want_freq = rope_inv_freq(16, 500000.0, LLAMA3)
    want = angles(model.layers[0].mixer.rope, 32768)
    model.to(torch.bfloat16)
    rope = model.layers[0].mixer.rope
    assert model.layers[0].mixer.q_proj.weight.dtype == torch.bfloat16
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, want_freq)
    got = angles(rope, 32768)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # bf16 activations get the fp32 table rounded once, not angles computed from a bf16 inv_freq
    cos_bf16, _ = rope.cos_sin(torch.tensor([[32768]]), torch.bfloat16)
    assert torch.equal(cos_bf16, want[0].to(torch.bfloat16))
    model.half().float()
    assert torch.equal(model.layers[1].mixer.rope.inv_freq, want_freq)


def test_meta_built_model_materializes_exact_tables():
    """Built on the meta device, then `to_empty`: the tables are recomputed, not left as garbage."""
    with torch.device("meta"):
        model = tiny(rope_scaling=None, rope_theta=10000.0)
    assert model.layers[0].mixer.rope.inv_freq.is_meta
    model.to_empty(device="cpu")
    rope = model.layers[1].mixer.rope
    assert torch.equal(rope.inv_freq, rope_inv_freq(16, 10000.0))
    rope.inv_freq.fill_(0.0)  # e.g. left empty by a loader
    rope.reset_buffers()
    assert torch.equal(rope.inv_freq, rope_inv_freq(16, 10000.0))
