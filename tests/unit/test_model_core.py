"""HybridLM basics: shapes, vocab padding, packed documents, GDN options, bad input."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, ArchConfigError, HybridLM


def tiny_arch(**overrides) -> ArchConfig:
    base = dict(
        family="llama", vocab_size=90, padded_vocab_size=128, hidden_size=64, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, layer_pattern="AGAG", gdn_chunk_size=8,
    )
    base.update(overrides)
    return ArchConfig(**base)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"gdn_conv_size": 4, "gdn_expand_kv": False, "attention_bias": True, "tie_embeddings": True},
        {"sliding_window": 5, "sandwich_norm": True, "norm_unit_offset": True, "qk_norm": True,
         "mlp_activation": "gelu_tanh", "embed_scale": 8.0, "layer_pattern": "GA|AG"},
    ],
    ids=["plain", "conv_gqa_bias_tied", "gemma_like"],
)
def test_packed_documents_equal_separate_runs(overrides):
    """Packing two documents in a row must give each document's own logits (attention masked,
    GDN state and conv taps reset, positions restarted)."""
    model = HybridLM(tiny_arch(**overrides)).eval()
    a, b = torch.randint(0, 90, (1, 11)), torch.randint(0, 90, (1, 14))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 11 + [1] * 14])
    with torch.no_grad():
        logits = model(packed, doc_ids=doc_ids)
        assert logits.shape == (1, 25, 90)
        torch.testing.assert_close(logits[:, :11], model(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[:, 11:], model(b), rtol=1e-5, atol=1e-5)


def test_backward_reaches_every_parameter():
    model = HybridLM(tiny_arch(gdn_conv_size=4))
    model(torch.randint(0, 90, (2, 19))).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_state_dict_names_follow_contract():
    model = HybridLM(tiny_arch(gdn_conv_size=4, sandwich_norm=True, qk_norm=True, attention_bias=True))
    names = set(model.state_dict())
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight", "layers.0.post_attn_norm.weight",
            "layers.0.mixer.q_norm.weight", "layers.0.mixer.q_proj.bias", "layers.1.mixer.A_log",
            "layers.1.mixer.dt_bias", "layers.1.mixer.b_proj.bias", "layers.1.mixer.o_norm.weight",
            "layers.1.mixer.v_conv1d.weight", "layers.1.mixer.k_proj.bias"} <= names
    assert model.state_dict()["layers.1.mixer.q_conv1d.weight"].shape == (64, 1, 4)
    assert all("rope" not in n for n in names)


def test_pattern_must_match_layer_count():
    with pytest.raises(ArchConfigError, match="layer_pattern"):
        tiny_arch(layer_pattern="AGA")


@pytest.mark.parametrize("overrides", [{}, {"gdn_conv_size": 4, "gdn_expand_kv": False}], ids=["silu", "conv_gqa"])
def test_gdn_convolutions_and_gates_of_layers_side_by_side_are_each_layers_own(overrides):
    """Several layers' q/k/v convolutions and gates in one call (channels and heads concatenated,
    as the statistics pass's readout sums run them) give each layer's own values, bit for bit."""
    from megatron_tc.model.gdn import GatedDeltaNet, convolved_heads, decay_and_write

    arch = tiny_arch(**overrides)
    torch.manual_seed(0)
    mixers = [GatedDeltaNet(arch, i).eval() for i in range(3)]
    xs = [torch.randn(2, 9, arch.hidden_size) for _ in mixers]
    doc_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    with torch.no_grad():
        own = [m.qkv(x, doc_ids) for m, x in zip(mixers, xs)]
        own_gates = [m.gates(x) for m, x in zip(mixers, xs)]
        projected = [torch.cat([getattr(m, f"{n}_proj")(x) for m, x in zip(mixers, xs)], -1) for n in "qkv"]
        conv = ([torch.cat([getattr(m, f"{n}_conv1d").weight for m in mixers]) for n in "qkv"]
                if arch.gdn_conv_size else None)
        together, _ = convolved_heads(projected, conv, arch.head_dim, arch.num_heads // mixers[0].kv_heads, doc_ids)
        gates = decay_and_write(*(torch.cat(parts, -1) for parts in (
            [m.a_proj(x) for m, x in zip(mixers, xs)], [m.b_proj(x) for m, x in zip(mixers, xs)],
            [m.A_log for m in mixers], [m.dt_bias for m in mixers])))
    for i in range(3):
        assert torch.equal(together[i], torch.cat([o[i] for o in own], dim=2)), "qkv"[i]
    for i in range(2):
        assert torch.equal(gates[i], torch.cat([o[i] for o in own_gates], dim=2)), ("g", "beta")[i]
