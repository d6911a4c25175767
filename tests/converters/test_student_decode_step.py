"""The exported student's decoding step (one token per row after a prefill) against independent
references: its attention against float64 masked softmax attention, and whole decoding steps
(packed projections, one convolution over q/k/v, shared RoPE tables) against the full forward."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.convert.hf_student import MegatronTCCache, MegatronTCConfig, MegatronTCForCausalLM
from megatron_tc.export import attention_megatron_tc as attention
from megatron_tc.export import layers_megatron_tc as layers
from tests.converters.helpers import tiny_arch


def reference_attention(q, k, v, allowed, scale):
    """float64 softmax attention, KV heads repeated; q [B, Hq, 1, D], allowed [B, L] -> [B, Hq, 1, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_decode_attention_equals_float64_reference_and_prefix_equals_full_buffer():
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, capacity, filled = 3, 4, 2, 16, 41, 29
    q = torch.randn(b, hq, 1, d, generator=gen)
    k, v = torch.randn(b, hkv, capacity, d, generator=gen), torch.randn(b, hkv, capacity, d, generator=gen)
    allowed = torch.zeros(b, capacity, dtype=torch.bool)
    allowed[:, :filled] = True
    allowed[1, :5], allowed[2, :11] = False, False  # left padding of rows 1 and 2
    bias = torch.where(allowed, 0.0, float("-inf"))[:, None, None, :]
    scale = d**-0.5

    full = attention.decode_attention(q, k, v, bias, scale)  # the slots after `filled` hold stale values
    prefix = attention.decode_attention(q, k[:, :, :filled], v[:, :, :filled], bias[..., :filled], scale)
    ref = reference_attention(q, k, v, allowed, scale)
    assert (full.double() - ref).abs().max().item() <= 1e-5
    assert (prefix - full).abs().max().item() <= 1e-6
    # and the same as the attention SDPA computes with a boolean mask over the whole buffer
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed[:, None, None, :], scale=scale)
    assert (full - sdpa).abs().max().item() <= 1e-5


def student(**overrides) -> MegatronTCForCausalLM:
    torch.manual_seed(0)
    model = MegatronTCForCausalLM(MegatronTCConfig.from_arch(tiny_arch("GAGG", **overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in model.model.layers:
            if hasattr(layer.mixer, "A_log"):
                layer.mixer.A_log.uniform_(0, 2.7)
    return model


ARCHS = {"qk_norm_bias_conv": {}, "plain": dict(qk_norm=False, attention_bias=False),
         "gdn_grouped_kv_no_conv": dict(gdn_expand_kv=False, gdn_conv_size=0, qk_norm=False)}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS, ids=list(ARCHS))
def test_decoding_steps_equal_the_full_forward(arch, static, monkeypatch):
    model = student(**ARCHS[arch])
    steps = []
    original = layers.GatedDeltaNet.decode_step
    monkeypatch.setattr(layers.GatedDeltaNet, "decode_step", lambda self, x, c: steps.append(1) or original(self, x, c))
    ids = torch.randint(3, 300, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        cache = MegatronTCCache(model.config, static_len=20 if static else None)
        model(input_ids=ids[:, :9], cache=cache)
        for i in range(9, 13):
            step = model(input_ids=ids[:, i:i + 1], cache=cache).logits[:, 0]
            assert (step - full[:, i]).abs().max().item() <= 1e-4, f"decoding step at position {i}"
    assert len(steps) == 4 * 3, "the GDN layers did not take the decoding step"


def test_packed_projections_follow_in_place_weight_edits():
    model = student()
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = MegatronTCCache(model.config)
        model(input_ids=ids[:, :6], cache=cache)
        model(input_ids=ids[:, 6:7], cache=cache)  # builds the packed weights
        for layer in model.model.layers:
            layer.mixer.q_proj.weight.mul_(1.5)
            layer.mixer.k_proj.bias.add_(0.1)
        cache = MegatronTCCache(model.config)
        model(input_ids=ids[:, :7], cache=cache)
        step = model(input_ids=ids[:, 7:8], cache=cache).logits[:, 0]
        full = model(input_ids=ids, use_cache=False).logits[:, 7]
    assert (step - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tokens", [1, 9])  # a one-token forward takes attention's packed q/k/v too
def test_packed_projections_pass_gradients_to_every_weight(tokens):
    """With gradients on, the packed matmuls give each projection and convolution weight the
    gradient of the same model written with one Linear / Conv1d per weight (a detached packed copy
    would give them none)."""
    model = student()
    ids = torch.randint(3, 300, (2, tokens), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # a packed copy exists from an inference forward before training
        model(input_ids=ids, use_cache=False)
    model.train()
    model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    def separate(self, x):  # the projections one Linear at a time, as the layer's names describe
        b, t, _ = x.shape
        y = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return y, self.a_proj(x), self.b_proj(x), self.g_proj(x).reshape(b, t, self.heads, self.head_dim)

    def separate_conv(self):
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])

    mp = pytest.MonkeyPatch()
    mp.setattr(layers.GatedDeltaNet, "projections", separate)
    mp.setattr(layers.GatedDeltaNet, "conv_weight", separate_conv)
    mp.setattr(attention, "trains", lambda weights: True)  # attention's packing in the graph: exact
    try:
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    finally:
        mp.undo()
    names = [n for n in packed if any(part in n for part in ("_proj.", "_conv1d."))]
    assert any("conv1d" in n for n in names) and any("g_proj" in n for n in names)
    for name in names:
        ref = dict(model.named_parameters())[name].grad
        assert ref is not None, name
        # (one token from an empty state: the decay multiplies zeros, a_proj's gradient is 0)
        assert tokens == 1 and "a_proj" in name or ref.abs().max() > 0, name
        torch.testing.assert_close(packed[name], ref, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("expand_kv", [True, False], ids=["expanded_kv", "grouped_kv"])
def test_activated_heads_are_silu_of_each_projection_and_contiguous_for_fla(expand_kv):
    """q, k, v are SiLU of their channels (k and v repeated to the q heads when grouped); with as
    many k/v heads as q heads and no gradient each comes out contiguous (fla's kernels copy
    non-contiguous inputs), from the strided slice the packed projection gives."""
    layer = next(block.mixer for block in student(gdn_expand_kv=expand_kv).model.layers
                 if isinstance(block.mixer, layers.GatedDeltaNet))
    channels = sum(layer.qkv_channels)
    y = torch.randn(2, 7, channels + 5)[..., :channels]  # a slice of the packed output, as in forward
    with torch.no_grad():
        q, k, v = layer.activated_heads(y)
    group = layer.heads // layer.kv_heads
    expected = [z.reshape(2, 7, -1, layer.head_dim) for z in torch.nn.functional.silu(y).split(layer.qkv_channels, -1)]
    expected[1:] = [z.repeat_interleave(group, 2) for z in expected[1:]]
    assert group == 1 if expand_kv else group > 1
    for got, ref in zip((q, k, v), expected):
        assert got.shape == (2, 7, layer.heads, layer.head_dim)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        assert got.is_contiguous() or not expand_kv


def test_reset_static_cache_keeps_its_buffers_and_decodes_as_a_new_one():
    """generate() reuses a static cache (and its captured decoding step) by resetting it in place."""
    model = student()
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(3, 300, (2, 11), generator=gen), torch.randint(3, 300, (2, 11), generator=gen)
    with torch.no_grad():
        cache = MegatronTCCache(model.config, static_len=16)
        model(input_ids=first[:, :8], cache=cache)
        model(input_ids=first[:, 8:9], cache=cache)
        addresses = [x.data_ptr() for layer in cache.layers for x in layer.tensors().values()]
        cache.reset()
        assert cache.seen == 0 and all(not x.any() for layer in cache.layers for x in layer.tensors().values())
        fresh = MegatronTCCache(model.config, static_len=16)
        for start, stop in ((0, 8), (8, 9), (9, 10)):
            reused = model(input_ids=second[:, start:stop], cache=cache).logits
            assert torch.equal(reused, model(input_ids=second[:, start:stop], cache=fresh).logits)
        assert [x.data_ptr() for layer in cache.layers for x in layer.tensors().values()] == addresses
        cache.reset()
        model(input_ids=second[:1, :8], cache=cache)  # another batch size: new buffers, right values
        assert cache.layers[1].keys.shape[0] == 1 and cache.layers[0].state.shape[0] == 1
