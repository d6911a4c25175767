"""Gated DeltaNet numerics at extreme gates over long sequences: T = 32k on CPU with the chunked
PyTorch path (the CI training path), fp32 and bf16 inputs. Outputs and states must stay finite and
the state bounded: with L2-normalized keys and write strength in [0, 1] each of the Dk key
directions holds at most about one value, so ||S||_F <= sqrt(Dk) * max_t ||v_t|| (a capacity bound;
observed here, including for nearly parallel keys, where the state grows slowest to it)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_tc.model.ops.gated_delta_rule import gated_delta_rule

T, H, D, SEGMENT = 32768, 2, 32, 8192  # B = 1


def run_segments(q, k, v, g, beta, backend="chunk"):
    """The kernel over T in segments (state carried, as decoding in pieces does); returns the
    max |o| and the state's Frobenius norm after every segment."""
    state, max_out, norms = None, 0.0, []
    for s in range(0, q.shape[1], SEGMENT):
        part = slice(s, s + SEGMENT)
        o, state = gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part],
                                    initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                    chunk_size=64, backend=backend)
        assert torch.isfinite(o).all() and torch.isfinite(state).all(), f"non-finite after {s + SEGMENT} tokens"
        max_out = max(max_out, float(o.abs().max()))
        norms.append(float(state.float().norm(dim=(-2, -1)).max()))
    return max_out, norms


def extreme_gates(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """g [1, T, H]: every 7th token no decay, every 11th -inf (exp(A_log) overflowed), the rest down
    to -1e4 (decays that underflow); beta: every 3rd token exactly 1, the rest uniform in [0, 1)."""
    shape = (1, T, H)
    g = -torch.rand(shape, generator=gen).pow(4) * 1e4
    g[:, ::7] = 0.0
    g[:, ::11] = -math.inf
    beta = torch.rand(shape, generator=gen)
    beta[:, ::3] = 1.0
    return g, beta


@pytest.mark.parametrize("case", ["random keys x1e3, extreme gates", "nearly parallel keys, no decay, beta 1"])
def test_chunked_kernel_stays_finite_and_bounded_over_32k_tokens(case):
    gen = torch.Generator().manual_seed(0)
    q = 1e3 * torch.randn(1, T, H, D, generator=gen)
    v = torch.randn(1, T, H, D, generator=gen)
    if case.startswith("random"):
        k = 1e3 * torch.randn(1, T, H, D, generator=gen)  # unnormalized: the kernel's L2 norm handles it
        g, beta = extreme_gates(gen)
    else:  # the slowest case for the delta rule's state to settle
        k = torch.randn(D, generator=gen) + 0.01 * torch.randn(1, T, H, D, generator=gen)
        g, beta = torch.zeros(1, T, H), torch.ones(1, T, H)
    max_out, norms = run_segments(q, k, v, g, beta)
    bound = math.sqrt(D) * float(v.norm(dim=-1).max())
    assert max(norms) <= bound, (norms, bound)
    assert max_out <= bound  # |o| <= ||S|| * ||q|| * Dk^-1/2 with unit q


def test_extreme_gates_chunked_equals_recurrent():
    """The chunked path is the recurrence, also where decays underflow or overflow (short T)."""
    gen = torch.Generator().manual_seed(1)
    t = 192
    q, k, v = (torch.randn(1, t, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, t, H, generator=gen, dtype=torch.float64).pow(4) * 1e4
    g[..., ::5, :] = -math.inf
    g[..., ::7, :] = 0.0
    beta = torch.rand(1, t, H, generator=gen, dtype=torch.float64)
    outs = [gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, chunk_size=64,
                             backend=b) for b in ("chunk", "recurrent")]
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-9, atol=1e-9)


HEAD_PARAMS = [(-20.0, 0.0), (9.0, 50.0), (20.0, 50.0), (0.0, -200.0)]  # (A_log, dt_bias) of the 4 heads:
# no decay; A_log and dt_bias large (g ~ -4e5); g ~ -2e10 (decay underflows); softplus underflows (g = 0)


def gdn_layer(dtype: torch.dtype, params=HEAD_PARAMS, heads: int = 4):
    from megatron_tc.model.config import ArchConfig
    from megatron_tc.model.gdn import GatedDeltaNet

    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=64, num_layers=1, num_heads=heads,
                      num_kv_heads=heads, head_dim=D, intermediate_size=64, layer_pattern="G", gdn_b_bias=True,
                      gdn_chunk_size=64)
    torch.manual_seed(0)
    layer = GatedDeltaNet(arch, 0)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([a for a, _ in params]))
        layer.dt_bias.copy_(torch.tensor([b for _, b in params]))
        layer.b_proj.bias.fill_(30.0)  # write strength sigmoid(~30) == 1 in fp32
    return layer.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_with_extreme_parameters_stays_finite_over_32k_tokens(dtype):
    """The layer itself (its projections, gates, kernel and output norm) on unnormalized inputs
    (scale 100), one head per extreme; the decoding cache returns the final state."""
    from megatron_tc.model.cache import GDNCache

    layer = gdn_layer(dtype)
    x = 100.0 * torch.randn(1, T, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    cache = GDNCache()
    with torch.no_grad():
        out = layer(x, cache=cache)
        v = layer.qkv(x)[2]
    assert torch.isfinite(out).all(), "the layer's output is not finite"
    assert torch.isfinite(cache.state).all()
    norms = cache.state.float().norm(dim=(-2, -1))[0]
    assert (norms <= math.sqrt(D) * v.float().norm(dim=-1).amax(dim=(0, 1))).all(), norms


def test_layer_parameters_cannot_make_the_decay_nan():
    layer = gdn_layer(torch.float32, [(100.0, -200.0)], heads=1)
    x = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        g, _ = layer.gates(x)
        out = layer(x)
    assert torch.isfinite(out).all() and not torch.isnan(g).any()
