"""Sweep 2's value-grid Triton kernel (`calibrate.value_grid_triton`) == its PyTorch reference.

The parity tests run the kernel in Triton's interpreter: tests/unit/test_kernels_interpreted.py
runs this file in a subprocess with the triton that tools/setup_env.sh keeps apart from the
project's environment. The dispatch test runs everywhere. The GPU twin is in tests/gpu/test_stats_kernel_cuda.py.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_tc.calibrate import readout
from megatron_tc.calibrate.moments import STATS_KERNEL_ENV

interpreter = pytest.mark.skipif(
    not (importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and TRITON_INTERPRET=1 (see the module docstring)",
)


def values(tokens: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """v [tokens, heads, D] fp32 with heads of different spreads (silu's two regimes)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 0.7, heads)[None, :, None]
    return torch.randn(tokens, heads, dim, generator=gen) * spread


@interpreter
@pytest.mark.parametrize("tokens, heads, dim", [(40, 1, 16), (150, 3, 64), (129, 2, 24)])
def test_kernel_matches_the_reference(tokens, heads, dim):
    from megatron_tc.calibrate.value_grid_triton import value_grid_sums

    v = values(tokens, heads, dim)
    scales = readout.VALUE_SCALE_GRID.float().view(-1, 1, 1, 1)
    got = value_grid_sums(v, scales)
    ref = readout.value_grid_reference(v, scales)
    assert got.dtype == torch.float64 and got.shape == (heads, len(readout.VALUE_SCALE_GRID))
    # fp32 values summed in fp64 on both sides: the order of the fp64 additions differs
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@interpreter
def test_kernel_reads_strided_heads():
    """Heads sliced out of a wider tensor (a stride over tokens larger than heads x D)."""
    from megatron_tc.calibrate.value_grid_triton import value_grid_sums

    wide = values(70, 5, 16, seed=1)
    v = wide[:, 1:4]
    scales = readout.VALUE_SCALE_GRID.float().view(-1, 1, 1, 1)
    torch.testing.assert_close(value_grid_sums(v, scales), readout.value_grid_reference(v.contiguous(), scales),
                               rtol=1e-6, atol=0)


def test_layers_value_grid_takes_the_reference_on_cpu(monkeypatch):
    """On CPU tensors (and with $MEGATRON_TC_STATS_KERNEL=reference) the grid is the reference's
    sums, k/v heads repeated to the query heads."""
    from types import SimpleNamespace

    monkeypatch.setenv(STATS_KERNEL_ENV, "auto")
    v = values(33, 2, 8)
    mixer = SimpleNamespace(num_heads=4)
    grid = readout.layers_value_silu_grid([mixer], [v])
    ref = readout.value_grid_reference(v, readout.VALUE_SCALE_GRID.float().view(-1, 1, 1, 1))
    assert torch.equal(grid, ref.repeat_interleave(2, 0))
