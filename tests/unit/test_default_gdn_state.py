"""default_gdn_state draws only what is read, and every value it returns is bit for bit the
plain sequence's: a GatedDeltaNet built on the CPU with its constructor's init, Linear weights
redrawn from N(0, std), biases zeroed, gate parameters reset again."""
from dataclasses import replace

import pytest
import torch

from megatron_tc.calibrate import default_init
from megatron_tc.calibrate.default_init import default_gdn_state
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


def reference_state(arch, index, seed, std=0.02):
    """The plain sequence, every draw made."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 100003 + index)
        mixer = GatedDeltaNet(arch, index)
        with torch.no_grad():
            for module in mixer.modules():
                if isinstance(module, torch.nn.Linear):
                    torch.nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:
                        torch.nn.init.zeros_(module.bias)
            mixer.reset_gdn_parameters()
    return {k: v.clone() for k, v in mixer.state_dict().items()}


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("index,seed", [(0, 0), (2, 7)])
def test_every_value_equals_the_plain_sequence_in_any_reading_order(name, index, seed):
    want = reference_state(ARCHS[name], index, seed)
    forward, backward = default_gdn_state(ARCHS[name], index, seed), default_gdn_state(ARCHS[name], index, seed)
    assert list(forward) == list(want)
    got_backward = {key: backward[key] for key in reversed(list(backward))}
    for key, value in want.items():
        assert torch.equal(forward[key], value) and torch.equal(got_backward[key], value), key
        assert torch.equal(forward[key], value), key  # a second read is the same tensor


def test_a_float64_default_dtype_draws_the_same_sequence():
    torch.set_default_dtype(torch.float64)
    try:
        want, got = reference_state(ARCHS["short_conv"], 1, 2), default_gdn_state(ARCHS["short_conv"], 1, 2)
    finally:
        torch.set_default_dtype(torch.float32)
    for key, value in want.items():
        assert value.dtype == torch.float64 and torch.equal(got[key], value), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_skipping_a_uniform_draw_moves_the_generator_as_the_draw(dtype):
    torch.manual_seed(4)
    torch.empty(10, 3, dtype=dtype).uniform_()
    generator = torch.Generator().manual_seed(4)
    default_init._skip_uniform(torch.empty(10, 3, dtype=dtype), generator)
    assert torch.equal(generator.get_state(), torch.random.get_rng_state())


def test_the_caller_generators_are_untouched():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    state = default_gdn_state(ARCHS["short_conv"], 1, 3)
    state["a_proj.weight"]  # a lazy draw later on uses its own generator
    assert torch.equal(torch.rand(5), expected)


@pytest.mark.parametrize("words", [0, 1, 2, 7, 64, 1001])
def test_skipping_draws_moves_the_generator_as_uniform_draws(words, monkeypatch):
    monkeypatch.setattr(default_init, "SKIP_CHUNK", 3)  # several chunks
    torch.manual_seed(5)
    torch.empty(words).uniform_()
    generator = torch.Generator().manual_seed(5)
    default_init._skip_draws(words, generator)
    assert torch.equal(generator.get_state(), torch.random.get_rng_state())


@pytest.mark.parametrize("shape", [(16,), (4, 32), (5,), (3, 7), (48, 3)])
def test_skipping_a_normal_draw_moves_the_generator_as_the_draw(shape):
    torch.manual_seed(9)
    torch.empty(shape).normal_()
    generator = torch.Generator().manual_seed(9)
    default_init._skip_normal(torch.empty(shape), generator)
    assert torch.equal(generator.get_state(), torch.random.get_rng_state())


def test_states_made_on_threads_at_once_equal_those_made_one_by_one():
    """The statistics pass makes default states on a worker thread while the main one runs."""
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
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"} <= set(default._pending)
    for key in ("a_proj.weight", "g_proj.weight", "A_log"):
        assert torch.equal(params[key], reference_state(arch, 0, 0)[key])


def test_a_smollm2_shaped_layer_equals_the_plain_sequence():
    """Weights of 331,776 elements and a short convolution."""
    from megatron_tc.bench.models import smollm2_135m

    arch = replace(smollm2_135m(), gdn_conv_size=4)
    arch = arch.with_pattern("G" * arch.num_layers)
    want, got = reference_state(arch, 5, 1), default_gdn_state(arch, 5, 1)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_values_drawn_ahead_equal_the_plain_sequence_and_unread_weights_take_no_memory():
    """draw_read_values draws what closed forms read; the teacher-copied projections stay unallocated."""
    arch = ARCHS["attention_bias"]
    want, state = reference_state(arch, 1, 3), default_gdn_state(arch, 1, 3)
    assert all(state._state[f"{p}_proj.weight"].is_meta for p in "qkvoabg")
    state.draw_read_values()
    assert sorted(state._pending) == [f"{p}_proj.weight" for p in "koqv"]
    assert not any(state._state[key].is_meta for key in want if key not in state._pending)
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def test_a_structure_made_first_and_drawn_on_another_thread_gives_the_same_values():
    import threading

    want = reference_state(ARCHS["short_conv"], 2, 5)
    state = default_gdn_state(ARCHS["short_conv"], 2, 5, draw=False)
    assert state._state is None  # nothing drawn yet
    worker = threading.Thread(target=state.draw)
    worker.start()
    worker.join()
    assert list(state) == list(want)
    for key, value in want.items():
        assert torch.equal(state[key], value), key
