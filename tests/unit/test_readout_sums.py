"""Readout sums (sweep 2 of the statistics pass) against the formulas they started from, op for op:
every sum squared and reduced in fp64 after an fp64 copy, one value scale at a time. The pass
now multiplies in fp32 and accumulates in fp64 (no fp64 copies), several scales per kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_tc.calibrate.readout import VALUE_SCALE_GRID, readout_sums, student_read, value_silu_grid
from megatron_tc.model import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet

F64 = torch.float64


def reference_value_grid(mixer, x):
    v = mixer.v_proj(x.to(mixer.v_proj.weight.dtype)).float()
    b, t, _ = v.shape
    v = v.view(b * t, mixer.kv_heads, mixer.head_dim)
    out = torch.stack([F.silu(float(c) * v).to(F64).pow(2).sum(dim=(0, 2)) for c in VALUE_SCALE_GRID], dim=1)
    return out.repeat_interleave(mixer.num_heads // mixer.kv_heads, dim=0)


def reference_sums(mixer, candidates, x, y, out, o_weight, doc_ids):
    b, t, _ = x.shape
    h, d = mixer.num_heads, mixer.head_dim
    raw, g, beta = student_read(mixer, x, doc_ids)
    normed = mixer.o_norm(raw)
    yt = y.float().transpose(1, 2)
    us = [normed * (1.0 if w is None else F.silu(x.float() @ w.float().t()).view(b, t, h, d)) for w in candidates]
    u_all = torch.stack(us)
    return {"uy": (u_all * yt).to(F64).sum(dim=(1, 2, 4)), "uu": u_all.to(F64).pow(2).sum(dim=(1, 2, 4)),
            "yy": yt.to(F64).pow(2).sum(dim=(0, 1, 3)), "YY": out.to(F64).pow(2).sum(),
            "beta": beta.to(F64).sum(dim=(0, 1)), "g": g.to(F64).sum(dim=(0, 1)),
            "ry": (raw * yt).to(F64).sum(dim=(0, 1, 3)), "rr": raw.to(F64).pow(2).sum(dim=(0, 1, 3)),
            "vgrid": reference_value_grid(mixer, x)}


def test_readout_sums_equal_the_fp64_formulas():
    torch.manual_seed(0)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=24, num_layers=1, num_heads=3, num_kv_heads=1,
                      head_dim=8, intermediate_size=32, layer_pattern="G", gdn_expand_kv=False, gdn_chunk_size=8)
    mixer = GatedDeltaNet(arch, 0).eval()
    b, t, h, d = 2, 19, 3, 8
    x = torch.randn(b, t, 24)
    y, out = torch.randn(b, h, t, d).to(torch.bfloat16), torch.randn(b, t, 24).to(torch.bfloat16)  # a bf16 teacher
    candidates = [None, torch.randn(h * d, 24) * 0.2]
    doc_ids = torch.tensor([[0] * 11 + [1] * 8, [0] * 19])
    got = readout_sums(mixer, candidates, x, y, out, torch.randn(24, h * d), doc_ids)
    want = reference_sums(mixer, candidates, x, y, out, None, doc_ids)
    for key, value in want.items():
        assert got[key].dtype == F64 and got[key].shape == value.shape, key
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=0, msg=key)
    assert float(got["count"]) == b * t


def test_value_grid_is_the_same_whatever_the_scales_per_kernel():
    torch.manual_seed(1)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=8, intermediate_size=32, layer_pattern="G", gdn_chunk_size=8)
    mixer, x = GatedDeltaNet(arch, 0), torch.randn(2, 5, 16)
    one = value_silu_grid(mixer, x, max_elements=1)  # one scale per kernel
    many = value_silu_grid(mixer, x)  # the default: all 81 at once for these few tokens
    assert one.shape == (2, len(VALUE_SCALE_GRID))
    torch.testing.assert_close(one, many, rtol=1e-12, atol=0)
    torch.testing.assert_close(many, reference_value_grid(mixer, x), rtol=1e-6, atol=0)


@torch.no_grad()
def test_all_candidates_at_once_equal_one_at_a_time_in_fp64():
    """The gates of every candidate from one matmul, mapped through o_proj in one batched matmul:
    u, G and r (candidate-major, None anywhere in the list) equal each candidate on its own in fp64."""
    from megatron_tc.calibrate.readout import gate_values, gated_reads

    torch.manual_seed(2)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=20, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=6, intermediate_size=32, layer_pattern="G", gdn_chunk_size=8)
    mixer = GatedDeltaNet(arch, 0).eval()
    b, t, h, d = 2, 7, 2, 6
    x, o_weight = torch.randn(b, t, 20), torch.randn(20, h * d)
    y, out = torch.randn(b, h, t, d), torch.randn(b, t, 20)
    candidates = [torch.randn(h * d, 20) * 0.3, None, torch.randn(h * d, 20), torch.randn(h * d, 20) * 2, None]
    raw, _, _ = student_read(mixer, x, None)
    normed = mixer.o_norm(raw).double()
    want_u = [normed * (1.0 if w is None else F.silu(x.double() @ w.double().t()).view(b, t, h, d))
              for w in candidates]
    got_u = torch.cat(gated_reads(mixer.o_norm(raw), gate_values(x, candidates), candidates))
    assert got_u.shape == (len(candidates), b, t, h, d)
    torch.testing.assert_close(got_u.double(), torch.stack(want_u), rtol=1e-5, atol=1e-6)
    o_heads = o_weight.double().view(20, h, d)  # [hidden, H, D]
    rows = torch.stack([torch.einsum("bthd,nhd->hbtn", u, o_heads) for u in want_u]).reshape(len(candidates) * h, -1)
    got = readout_sums(mixer, candidates, x, y, out, o_weight)
    gram, r = rows @ rows.t(), rows @ out.double().reshape(-1)  # fp32 matmuls: errors relative to the largest
    torch.testing.assert_close(got["G"], gram, rtol=0, atol=1e-6 * float(gram.abs().max()))
    torch.testing.assert_close(got["r"], r, rtol=0, atol=1e-6 * float(r.abs().max()))
    yt = y.double().transpose(1, 2)
    uy = torch.stack([(u * yt).sum(dim=(0, 1, 3)) for u in want_u])
    uu = torch.stack([u.pow(2).sum(dim=(0, 1, 3)) for u in want_u])
    torch.testing.assert_close(got["uy"], uy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["uu"], uu, rtol=1e-5, atol=1e-6)


def test_long_products_equal_fp64_products_over_blocks_and_the_rest():
    """U U^T and U Y from fp32 products over blocks of PRODUCT_TOKENS tokens, summed in fp64: equal
    to the fp64 products within fp32 rounding, whether the tokens fill whole blocks, leave a rest,
    or are fewer than one block; rows summed in one call make the products of each row alone."""
    from megatron_tc.calibrate.readout import PRODUCT_TOKENS, long_products

    torch.manual_seed(0)
    width = 6
    for tokens in (3 * PRODUCT_TOKENS, 3 * PRODUCT_TOKENS + 5, PRODUCT_TOKENS - 1):
        U, Y = torch.randn(7, tokens * width), torch.randn(tokens * width)
        gram, r = long_products(torch.cat([U, Y[None]]), width)
        assert gram.dtype == r.dtype == F64
        torch.testing.assert_close(gram, U.double() @ U.double().t(), rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(r, U.double() @ Y.double(), rtol=1e-6, atol=1e-4)
        half = tokens // 2 * width  # two rows of tokens // 2: blocks and rests of each row
        V = torch.cat([U, Y[None]])
        both = long_products(V[:, :2 * half], width, rows=2)
        apart = [long_products(V[:, i * half:(i + 1) * half], width) for i in (0, 1)]
        for got, first, second in zip(both, *apart):
            torch.testing.assert_close(got, first + second, rtol=1e-13, atol=0)


def test_value_grid_once_per_group_of_repeated_value_heads_equals_every_head():
    """A closed form that repeats the teacher's k/v heads (value_groups) has its value grid summed once
    per group: the same sums as over every query head."""
    torch.manual_seed(2)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=32, layer_pattern="G", gdn_chunk_size=8, attention_bias=True)
    mixer, x = GatedDeltaNet(arch, 0), torch.randn(2, 5, 16)
    with torch.no_grad():  # heads (0, 1) and (2, 3) share their value rows, as expand_kv makes them
        for param in (mixer.v_proj.weight, mixer.v_proj.bias):
            heads = param.view(2, 2, 8, -1)
            heads[:, 1] = heads[:, 0]
    every = value_silu_grid(mixer, x)
    mixer.value_groups = 2
    torch.testing.assert_close(value_silu_grid(mixer, x), every, rtol=1e-12, atol=0)
    assert every.shape == (4, len(VALUE_SCALE_GRID))


def test_without_products_every_other_sum_is_the_same_bit_for_bit():
    """products=False leaves out the sums after o_proj (no key, not zeros) and changes no other sum;
    the empty accumulators have the same keys and shapes as the sums."""
    from megatron_tc.calibrate.readout import PRODUCT_KEYS, empty_readout_sums

    torch.manual_seed(3)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=20, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=6, intermediate_size=32, layer_pattern="G", gdn_chunk_size=8)
    mixer = GatedDeltaNet(arch, 0).eval()
    b, t, h, d = 2, 9, 2, 6
    x, o_weight, y, out = torch.randn(b, t, 20), torch.randn(20, h * d), torch.randn(b, h, t, d), torch.randn(b, t, 20)
    candidates = [None, torch.randn(h * d, 20) * 0.3, torch.randn(h * d, 20)]
    doc_ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    full = readout_sums(mixer, candidates, x, y, out, o_weight, doc_ids)
    lean = readout_sums(mixer, candidates, x, y, out, o_weight, doc_ids, products=False)
    assert set(PRODUCT_KEYS) <= set(full) and not set(PRODUCT_KEYS) & set(lean)
    assert set(lean) == set(full) - set(PRODUCT_KEYS)
    for key, value in lean.items():
        assert torch.equal(value, full[key]), key
    for products, sums in ((True, full), (False, lean)):
        empty = empty_readout_sums(len(candidates), h, d, products=products)
        assert {k: v.shape for k, v in empty.items()} == {k: v.shape for k, v in sums.items()}


def test_readout_groups_without_products_count_only_the_reads():
    """Without the products the U buffer [H*C, tokens*hidden] is not made: more tokens merge per call, the
    reads [C + 2, tokens, H, D] fp32 still within READOUT_GROUP_BYTES."""
    from megatron_tc.calibrate.stats import READOUT_GROUP_BYTES, readout_group_tokens

    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=32)
    with_products, without = readout_group_tokens(arch, 8), readout_group_tokens(arch, 8, products=False)
    assert with_products == READOUT_GROUP_BYTES // (4 * 9 * (8 * 576 + 10 * 64))
    assert without == READOUT_GROUP_BYTES // (4 * 9 * 10 * 64) > with_products


@pytest.mark.parametrize("conv,value_groups", [(0, 1), (4, 1), (0, 2)])
def test_layers_summed_at_once_equal_each_layer_alone(conv, value_groups):
    """layers_readout_sums (heads of 3 layers stacked, packed documents, o_proj products) against
    readout_sums of each layer: the same up to fp32 rounding of the larger operations."""
    from megatron_tc.calibrate.readout import layers_readout_sums

    torch.manual_seed(3)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=24, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=6, intermediate_size=32, layer_pattern="GGG", gdn_chunk_size=8, gdn_conv_size=conv,
                      gdn_expand_kv=value_groups > 1)
    b, t, h, d = 2, 21, 4, 6
    mixers, candidates, xs, ys, outs, o_weights = [], [], [], [], [], []
    for index in range(3):
        mixer = GatedDeltaNet(arch, index).eval()
        with torch.no_grad():
            mixer.A_log.add_(0.3 * index)
            mixer.o_norm.weight.copy_(torch.rand(d) + 0.5)
            if value_groups > 1:  # the closed form's repeated k/v heads: pairs of equal v_proj rows
                mixer.v_proj.weight.copy_(mixer.v_proj.weight.view(2, 2, d, -1)[:, :1].expand(-1, 2, -1, -1).reshape(h * d, -1))
        mixer.value_groups = value_groups
        mixers.append(mixer)
        candidates.append([None, torch.randn(h * d, 24) * 0.3, torch.randn(h * d, 24)])
        xs.append(torch.randn(b, t, 24))
        ys.append(torch.randn(b, h, t, d))
        outs.append(torch.randn(b, t, 24))
        o_weights.append(torch.randn(24, h * d))
    doc_ids = torch.tensor([[0] * 9 + [1] * 12, [0] * 21])
    together = layers_readout_sums(mixers, candidates, xs, ys, outs, o_weights, doc_ids)
    for index in range(3):
        alone = readout_sums(mixers[index], candidates[index], xs[index], ys[index], outs[index], o_weights[index],
                             doc_ids)
        assert together[index].keys() == alone.keys()
        for key, value in alone.items():
            scale = float(value.abs().max().clamp_min(1e-30))
            torch.testing.assert_close(together[index][key], value, rtol=0, atol=1e-6 * scale, msg=f"{index} {key}")
