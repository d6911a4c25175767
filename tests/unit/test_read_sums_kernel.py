"""Sweep 2's read-sums Triton kernel (`calibrate.read_sums_triton`) == the fp64 formulas and the
PyTorch path of `readout.layers_readout_sums`.

Every test here needs triton (the kernel's module imports it) and the parity tests Triton's
interpreter: tests/unit/test_kernels_interpreted.py runs this file in a subprocess with the triton
that tools/setup_env.sh keeps apart from the project's environment. The GPU twin is in
tests/gpu/test_stats_kernel_cuda.py.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_tc.calibrate.moments import STATS_KERNEL_ENV
from megatron_tc.calibrate.readout import layers_readout_sums
from megatron_tc.model import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet

F64 = torch.float64
HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(
    not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and TRITON_INTERPRET=1 (see the module docstring)",
)


def fp64_read_sums(u, r, y):
    """[heads, 5] of u.y, r.y, y.y, u.u, r.r over every dimension but the heads [-2]: fp32
    products (as the PyTorch path forms them) summed in fp64."""
    u, r, y = (x.float() for x in (u, r, y))
    dims = tuple(i for i in range(u.dim()) if i != u.dim() - 2)
    return torch.stack([(a * b).sum(dims, dtype=F64) for a, b in ((u, y), (r, y), (y, y), (u, u), (r, r))], dim=1)


@interpreter
@pytest.mark.parametrize("shape, y_dtype", [((2, 37, 3, 16), torch.float32), ((1, 130, 2, 24), torch.bfloat16)])
def test_kernel_equals_the_fp64_sums(shape, y_dtype):
    """Tokens not a multiple of the block, D not a power of 2, a 16-bit teacher's heads."""
    from megatron_tc.calibrate.read_sums_triton import read_sums

    gen = torch.Generator().manual_seed(0)
    u, r, y = (torch.randn(*shape, generator=gen) * s for s in (1.0, 3.0, 0.5))
    y = y.to(y_dtype)
    got = read_sums(u, r, y)
    assert got.dtype == F64 and got.shape == (shape[-2], 5)
    # the same fp32 products summed in fp64 in another order
    torch.testing.assert_close(got, fp64_read_sums(u, r, y), rtol=1e-12, atol=0)


@interpreter
def test_kernel_reads_a_transposed_teacher_output():
    """y as the sweep hands it over: [B, H, T, D] transposed to [B, T, H, D] (no copy)."""
    from megatron_tc.calibrate.read_sums_triton import read_sums

    gen = torch.Generator().manual_seed(1)
    u, r = torch.randn(2, 20, 3, 8, generator=gen), torch.randn(2, 20, 3, 8, generator=gen)
    y = torch.randn(2, 3, 20, 8, generator=gen).transpose(1, 2)
    torch.testing.assert_close(read_sums(u, r, y), fp64_read_sums(u, r, y), rtol=1e-12, atol=0)


@interpreter
def test_layers_readout_sums_through_the_kernel_equal_the_pytorch_path(monkeypatch):
    """Two layers stacked, packed documents, candidates without an output gate and no products (as
    taylor_calibrate reads them): the kernel's sums equal the PyTorch path's within fp64 order."""
    torch.manual_seed(2)
    arch = ArchConfig(family="llama", vocab_size=64, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=6, intermediate_size=32, layer_pattern="GG", gdn_chunk_size=8)
    b, t, h, d = 2, 21, 4, 6
    mixers = [GatedDeltaNet(arch, i).eval() for i in range(2)]
    xs = [torch.randn(b, t, 24) for _ in mixers]
    ys = [torch.randn(b, h, t, d).to(torch.bfloat16) for _ in mixers]
    outs = [torch.randn(b, t, 24) for _ in mixers]
    o_weights = [torch.randn(24, h * d) for _ in mixers]
    doc_ids = torch.tensor([[0] * 9 + [1] * 12, [0] * 21])
    got = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv(STATS_KERNEL_ENV, mode)
        got[mode] = layers_readout_sums(mixers, [[None, None]] * 2, xs, ys, outs, o_weights, doc_ids, products=False)
    for ref, new in zip(got["reference"], got["triton"]):
        assert set(ref) == set(new)
        for key in ref:  # the read sums: fp64 order only; vgrid: its own kernel's fp32 SiLU
            rtol = 1e-6 if key == "vgrid" else 1e-12
            torch.testing.assert_close(new[key], ref[key], rtol=rtol, atol=0, msg=key)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (see the module docstring)")
def test_mismatched_shapes_are_refused():
    from megatron_tc.calibrate.read_sums_triton import read_sums

    with pytest.raises(ValueError, match="of one shape"):
        read_sums(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 3, 8))
