"""RoPE tables stay fp32 (and exact) whatever the model is cast or moved to; a forward makes them once per RoPE."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_tc.model import ArchConfig, HybridLM
from megatron_tc.model.rope import RotaryEmbedding, rope_inv_freq, shared_tables

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


def _count_tables(monkeypatch) -> list[tuple[float, torch.dtype]]:
    made = []
    make = RotaryEmbedding.make_tables

    def counted(self, position_ids, dtype):
        made.append((self.theta, dtype))
        return make(self, position_ids, dtype)

    monkeypatch.setattr(RotaryEmbedding, "make_tables", counted)
    return made


def test_a_forward_makes_each_ropes_tables_once_and_equals_tables_per_layer(monkeypatch):
    """Gemma3-style layers: sliding ones with a local theta, full ones with the global theta and
    scaling; a forward makes one pair of tables per RoPE, and its logits are those of tables made
    in every layer, bit for bit."""
    torch.manual_seed(0)
    model = tiny(num_layers=4, layer_pattern="AAAA", sliding_window=4, rope_local_theta=10000.0,
                 attn_layer_types=["sliding", "full", "sliding", "full"]).eval()
    ids = torch.randint(0, 50, (2, 9))
    made = _count_tables(monkeypatch)
    with torch.no_grad():
        shared = model(ids)
    assert sorted(made, key=str) == [(10000.0, torch.float32), (500000.0, torch.float32)]
    made.clear()
    with torch.no_grad():
        again = model(ids)  # a new forward: its own tables (none are kept from the last one)
    assert len(made) == 2 and torch.equal(again, shared)
    monkeypatch.setattr("megatron_tc.model.transformer.shared_tables", contextlib.nullcontext)
    made.clear()
    with torch.no_grad():
        per_layer = model(ids)
    assert len(made) == 4 and torch.equal(per_layer, shared)


def test_shared_tables_follow_the_positions_tensor_and_its_changes(monkeypatch):
    rope = tiny().layers[0].mixer.rope
    made = _count_tables(monkeypatch)
    positions = torch.arange(6)[None]
    with shared_tables():
        first = rope.cos_sin(positions, torch.float32)
        assert rope.cos_sin(positions, torch.float32)[0] is first[0] and len(made) == 1
        rope.cos_sin(positions, torch.bfloat16)  # another dtype: its own tables
        other = rope.cos_sin(positions + 3, torch.float32)  # other positions: their own
        assert len(made) == 3 and not torch.equal(other[0], first[0])
        positions.add_(3)  # changed in place: the tables of its new values
        moved = rope.cos_sin(positions, torch.float32)
        assert len(made) == 4 and torch.equal(moved[0], other[0])
    rope.cos_sin(positions, torch.float32)  # outside: made at every call
    rope.cos_sin(positions, torch.float32)
    assert len(made) == 6


def test_gradients_with_activation_checkpointing_match_with_shared_tables():
    """Recomputed layers (reentrant checkpointing, outside the forward's sharing) make their tables
    again: the same gradients as without checkpointing."""
    torch.manual_seed(0)
    model = tiny(num_layers=3, layer_pattern="AAA")
    ids = torch.randint(0, 50, (2, 7))
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.set_activation_checkpointing(recompute)
        model(ids).float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_model_compiles_in_one_graph_with_its_own_tables():
    """torch.compile of the whole model (as the benchmarks' plain PyTorch anchor compiles its
    teacher) traces in one graph: no table sharing inside traced code, which stage 2's per-layer
    compile traces too."""
    torch.manual_seed(0)
    model = tiny(num_layers=2).eval()
    ids = torch.randint(0, 50, (1, 8))
    traced = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(traced(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rotate_by_the_signed_tables_equals_hugging_faces_formula_bit_for_bit(dtype, head_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 10000.0)
    positions = torch.tensor([[0, 1, 2, 7, 4095, 32768], [5, 6, 7, 8, 9, 10]])
    x = torch.randn(2, 3, 6, head_dim).mul(50).to(dtype)
    cos, sin = rope.cos_sin(positions, dtype)
    want = rope.rotate(x, cos, sin)
    cos_r, signed = rope.rotation_tables(positions, dtype)
    assert torch.equal(cos_r, cos)
    assert torch.equal(rope.rotate_by(x, cos_r, signed), want)
