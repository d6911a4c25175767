"""default_gdn_state: the keys, shapes and dtypes of a GatedDeltaNet's state dict, each value drawn
from its own seeded generator by the documented rule (an independent reference below), in any
reading order and on any thread."""
import math
from dataclasses import replace

import pytest
import torch

from megatron_tc.calibrate.default_init import default_gdn_state, parameter_seed
from megatron_tc.calibrate.strategies import LayerContext, copy_teacher
from megatron_tc.model import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet

BASE = ArchConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=64, layer_pattern="GAG")
ARCHS = {
    "default": BASE,
    "attention_bias": replace(BASE, attention_bias=True),
    "short_conv": replace(BASE, gdn_conv_size=4),
    "no_b_bias": replace(BASE, gdn_b_bias=False),
    "kv_heads": replace(BASE, gdn_expand_kv=False, gdn_conv_size=3),
    "odd_sizes": replace(BASE, hidden_size=33, num_heads=3, num_kv_heads=3, head_dim=5, attention_bias=True),
}


def reference_value(key, shape, dtype, index, seed, std=0.02):
    """The rule written out with plain torch calls (fla's A/dt formulas, PyTorch's Conv1d bound)."""
    gen = torch.Generator().manual_seed(parameter_seed(seed, index, key))
    if key == "A_log":
        return torch.empty(shape, dtype=dtype).uniform_(0, 16, generator=gen).log()
    if key == "dt_bias":
        u = torch.empty(shape, dtype=dtype).uniform_(generator=gen)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if key == "o_norm.weight":
        return torch.ones(shape, dtype=dtype)
    if "conv1d" in key:  # PyTorch's Conv1d init (kaiming_uniform_, a = sqrt(5)) on [C, 1, K]: U(+-1/sqrt(K))
        bound = 1 / math.sqrt(shape[-1])
        return torch.empty(shape, dtype=dtype).uniform_(-bound, bound, generator=gen)
    if key.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)


def reference_state(arch, index, seed):
    layout = GatedDeltaNet(arch, index, init=False).state_dict()
    return {k: reference_value(k, v.shape, v.dtype, index, seed) for k, v in layout.items()}


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("index,seed", [(0, 0), (2, 7)])
def test_every_value_follows_the_rule_in_any_reading_order(name, index, seed):
    want = reference_state(ARCHS[name], index, seed)
    forward, backward = default_gdn_state(ARCHS[name], index, seed), default_gdn_state(ARCHS[name], index, seed)
    assert list(forward) == list(want) and len(forward) == len(want)
    got_backward = {key: backward[key] for key in reversed(list(backward))}
    for key, value in want.items():
        got = forward[key]
        assert got.shape == value.shape and got.dtype == value.dtype and got.device.type == "cpu", key
        assert torch.equal(got, value) and torch.equal(got_backward[key], value), key
        assert forward[key] is got  # drawn once


def test_the_values_have_their_distributions():
    """A SmolLM2-shaped layer: the draws are what the rule says, not just repeatable."""
    from megatron_tc.bench.models import smollm2_135m

    arch = replace(smollm2_135m(), gdn_conv_size=4)
    state = default_gdn_state(arch.with_pattern("G" * arch.num_layers), 5, 1)
    g_proj = state["g_proj.weight"]
    assert abs(g_proj.mean()) < 2e-4 and abs(g_proj.std() - 0.02) < 2e-4  # 331,776 draws: 5+ sigma
    conv = state["q_conv1d.weight"]
    assert conv.abs().max() <= 0.5 and conv.abs().max() > 0.49 and abs(conv.mean()) < 0.03  # U(-1/2, 1/2), 2,304 draws
    a = state["A_log"].exp()
    assert 0 < a.min() and a.max() < 16
    dt = torch.nn.functional.softplus(state["dt_bias"])
    assert (dt >= 1e-4 - 1e-9).all() and (dt <= 0.1 + 1e-6).all()


def test_layers_and_seeds_draw_different_values():
    values = [default_gdn_state(BASE, index, seed)["g_proj.weight"] for index, seed in [(0, 0), (2, 0), (0, 1)]]
    assert not torch.equal(values[0], values[1]) and not torch.equal(values[0], values[2])


def test_a_float64_default_dtype_gives_float64_values():
    torch.set_default_dtype(torch.float64)
    try:
        want, got = reference_state(ARCHS["short_conv"], 1, 2), default_gdn_state(ARCHS["short_conv"], 1, 2)
    finally:
        torch.set_default_dtype(torch.float32)
    for key, value in want.items():
        assert value.dtype == torch.float64 and torch.equal(got[key], value), key


def test_the_caller_generators_are_untouched():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    state = default_gdn_state(ARCHS["short_conv"], 1, 3)
    state["a_proj.weight"], state["A_log"]
    assert torch.equal(torch.rand(5), expected)


def test_an_unknown_parameter_is_a_key_error():
    with pytest.raises(KeyError):
        default_gdn_state(BASE, 0)["q_norm.weight"]


def test_states_read_on_threads_at_once_equal_those_read_one_by_one():
    from concurrent.futures import ThreadPoolExecutor

    arch, keys = ARCHS["short_conv"], ("A_log", "dt_bias", "b_proj.weight", "q_conv1d.weight", "g_proj.weight")
    want = [{k: default_gdn_state(arch, i, 1)[k] for k in keys} for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: {k: default_gdn_state(arch, i, 1)[k] for k in keys}, range(4)))
    for one, other in zip(got, want):
        assert all(torch.equal(one[k], other[k]) for k in keys)


def test_copying_the_teacher_never_draws_the_projections_it_replaces():
    arch = ARCHS["attention_bias"]
    default = default_gdn_state(arch, 0)
    q, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    shapes = {"q_proj.weight": (q, hidden), "k_proj.weight": (kv, hidden), "v_proj.weight": (kv, hidden),
              "o_proj.weight": (hidden, q), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
    teacher = {k: torch.randn(shape) for k, shape in shapes.items()}  # the teacher attention's weights
    params = copy_teacher(LayerContext(0, arch, teacher, default))
    assert list(params) == list(default)
    assert not {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"} & set(default.drawn)
    assert list(default.drawn) == [k for k in default if k in default.drawn]  # read in the state dict's order
    for key in ("a_proj.weight", "g_proj.weight", "A_log"):
        assert torch.equal(params[key], reference_state(arch, 0, 0)[key])


@pytest.mark.parametrize("name", ["attention_bias", "short_conv", "kv_heads"])
def test_a_read_only_copy_shares_what_it_keeps_and_equals_the_copying_one(name):
    arch = ARCHS[name]
    q, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    shapes = {"q_proj.weight": (q, hidden), "k_proj.weight": (kv, hidden), "v_proj.weight": (kv, hidden),
              "o_proj.weight": (hidden, q)} | ({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
                                              if arch.attention_bias else {})
    teacher = {k: torch.randn(shape) for k, shape in shapes.items()}
    default = default_gdn_state(arch, 0)
    copied = copy_teacher(LayerContext(0, arch, teacher, default), replaced=("g_proj.weight",))
    shared = copy_teacher(LayerContext(0, arch, teacher, default, read_only=True), replaced=("g_proj.weight",))
    assert list(shared) == list(copied)
    for key, value in copied.items():
        assert shared[key].shape == value.shape and shared[key].dtype == value.dtype, key
        if not value.is_meta:
            assert torch.equal(shared[key], value), key
            source = teacher[key] if key in teacher else default[key]
            assert value.data_ptr() != source.data_ptr(), key  # the copying one owns its tensors
            repeated = key[:7] in ("k_proj.", "v_proj.") and arch.num_kv_heads != arch.gdn_kv_heads  # GQA: new either way
            assert (shared[key].data_ptr() == source.data_ptr()) != repeated, key
