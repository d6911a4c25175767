"""Sweep 1's fused Triton kernel (`calibrate.moments_triton`) == the PyTorch chunks on CUDA, and
sweep 2's value-grid and read-sums kernels (`calibrate.value_grid_triton`, `read_sums_triton`) ==
their references.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_stats_kernel_cuda.py` (well under
a minute; each dtype/block shape compiles once, a few seconds). Both paths compute in fp32 from
the same q/k/v (TF32 off for the reference's matmuls). Tolerances, relative to each statistic's
largest magnitude over heads: fp32 inputs 1e-5 (summation order only: the kernel's QK and P@V
dots run in IEEE fp32); bf16 inputs 5e-5 (QK products of bf16 are exact in both; the kernel's P@V
splits p into two bf16 halves, ~2^-17 relative, where the reference multiplies in fp32).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from megatron_tc.calibrate.moments import STATS_KERNEL_ENV, attention_sums  # noqa: E402


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def make_case(b, hq, hkv, t, d, docs, logit_scale, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=gen, device="cuda") * logit_scale
    k = torch.randn(b, hkv, t, d, generator=gen, device="cuda")
    v = torch.randn(b, hkv, t, d, generator=gen, device="cuda")
    o_weight = torch.randn(9 * d, hq * d, generator=gen, device="cuda")
    doc_ids = None
    if docs:  # packed documents of unequal lengths, boundaries off the 64-blocks
        doc_ids = torch.zeros(b, t, dtype=torch.long, device="cuda")
        doc_ids[:, t // 3 + 5:] = 1
        doc_ids[-1, t // 2 + 1:] = 2
        doc_ids[-1, t - 3:] = 3
    return q.to(dtype), k.to(dtype), v.to(dtype), o_weight, doc_ids


def worst_rel(got: dict, ref: dict) -> tuple[float, str]:
    return max((float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-30)), key) for key in ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, docs, window, logit_scale",
    [
        ((2, 9, 3, 1000, 64), False, None, 1.0),  # SmolLM2 heads (GQA 3:1), T not a multiple of 64
        ((2, 9, 3, 2048, 64), True, None, 2.0),  # packed documents
        ((2, 4, 2, 1500, 128), True, 256, 2.0),  # sliding window (hides the sink), head_dim 128
        ((1, 8, 8, 777, 64), True, None, 8.0),  # MHA, peaked rows: the sink holds almost all mass
        ((1, 4, 1, 300, 80), False, 100, 1.0),  # MQA, head_dim not a power of 2
    ],
)
def test_kernel_matches_pytorch_chunks_cuda(monkeypatch, shape, docs, window, logit_scale, dtype):
    q, k, v, o_weight, doc_ids = make_case(*shape, docs, logit_scale, dtype)
    out = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv(STATS_KERNEL_ENV, mode)
        out[mode] = attention_sums(q, k, v, 0.125, o_weight, doc_ids, window, 128)
    (ref, y_ref), (got, y_got) = out["reference"], out["triton"]
    tol = 1e-5 if dtype == torch.float32 else 5e-5
    err, key = worst_rel(got, ref)
    assert err < tol, f"{key}: {err:.2e}"
    y_err = float((y_got - y_ref).abs().max() / y_ref.abs().max())
    assert y_err < tol, f"y: {y_err:.2e}"


def test_auto_dispatch_takes_the_kernel_on_cuda(monkeypatch):
    from megatron_tc.calibrate.moments import use_stats_kernel

    monkeypatch.delenv(STATS_KERNEL_ENV, raising=False)
    assert use_stats_kernel(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("tokens, heads, dim", [(16384, 3, 64), (1000, 9, 64), (777, 4, 128), (300, 2, 80)])
def test_value_grid_kernel_matches_the_reference_cuda(monkeypatch, tokens, heads, dim):
    """SmolLM2's value heads at 16k tokens, tokens off the 64-blocks, head_dim 128 and 80."""
    from megatron_tc.calibrate import readout
    from megatron_tc.calibrate.value_grid_triton import value_grid_sums

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    spread = torch.logspace(-1, 0.7, heads, device="cuda")[None, :, None]  # silu's two regimes
    v = torch.randn(tokens, heads, dim, generator=gen, device="cuda") * spread
    scales = readout.VALUE_SCALE_GRID.float().cuda().view(-1, 1, 1, 1)
    got, ref = value_grid_sums(v, scales), readout.value_grid_reference(v, scales)
    # the same fp32 values up to SiLU's rounding (one ulp), summed in fp64 in another order
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    monkeypatch.delenv(STATS_KERNEL_ENV, raising=False)
    grid = readout.layers_value_silu_grid([type("Mixer", (), {"num_heads": heads})()], [v])
    assert torch.equal(grid, got)  # the pass takes the kernel on CUDA


@pytest.mark.parametrize("shape", [(4, 2048, 64, 128), (2, 777, 9, 64), (1, 300, 2, 80)])
def test_read_sums_kernel_equals_fp64_products_cuda(shape):
    """An 8B group's reads (4 x 2048 tokens, 64 heads of 128) and shapes off the 64-blocks: u, r
    fp32 and a bf16 teacher's heads y, against the products formed and summed in fp64."""
    from megatron_tc.calibrate.read_sums_triton import read_sums

    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    u, r, y = (torch.randn(*shape, generator=gen, device="cuda") * s for s in (1.0, 3.0, 0.5))
    y = y.bfloat16()
    yf = y.float()
    want = torch.stack([(a * b).sum((0, 1, 3), dtype=torch.float64)
                        for a, b in ((u, yf), (r, yf), (yf, yf), (u, u), (r, r))], dim=1)
    # the same fp32 products (the PyTorch path's) summed in fp64 in another order: the cross sums
    # of a million random products cancel to ~1e-3 of their terms, so fp64 order still shows
    torch.testing.assert_close(read_sums(u, r, y), want, rtol=1e-9, atol=0)


def test_finished_sums_come_from_the_gpu_exactly_after_the_kernels_that_make_them():
    from megatron_tc.calibrate.stats import _to_cpu
    from megatron_tc.calibrate.statsfile import TaylorStats

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float64, generator=g)
    sums = {"layers.0.y_sq": a @ a, "layers.0.count": a.sum(), "readout.x.w": (a[:3, :3] @ a[:3, :3]).float()}
    expected = {k: v.cpu() for k, v in sums.items()}  # a blocking copy each
    for _ in range(8):  # a busy stream: the pinned copies must wait for the kernels queued before them
        a = a @ a / a.norm()
    sums = {k: v.clone() for k, v in sums.items()}
    out = _to_cpu(TaylorStats({}, sums)).sums
    for key, value in expected.items():
        assert out[key].device.type == "cpu" and out[key].dtype == value.dtype
        assert not out[key].is_pinned(), key  # the pinned staging buffer is not what the stats keep
        assert torch.equal(out[key], value), key


def test_closed_forms_go_to_the_gpu_without_waiting_for_it():
    """Sweep 2 moves a group's closed forms while the device still sums the previous group: the
    asynchronous copy from pageable memory must neither synchronize nor wait for the queued kernels."""
    from megatron_tc.calibrate.readout_mixers import to_device_all

    g = torch.Generator().manual_seed(0)
    tensors = {"b_proj.weight": torch.randn(9, 576, generator=g), "dt_bias": torch.randn(9, generator=g),
               "index": torch.arange(7), "narrow": torch.randn(64, 64, generator=g).bfloat16()}
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(16):  # hundreds of milliseconds queued on the stream
        a = a @ a / a.norm()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device_all(tensors, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.cuda.current_stream().query()  # the host did not wait for the kernels above
    for key, value in tensors.items():
        assert moved[key].is_cuda and torch.equal(moved[key].cpu(), value), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 2048, 576), (1, 333, 2048)])
def test_wide_linear_of_16_bit_operands_equals_the_fp32_product(dtype, shape):
    """Sweep 2's projections of a bf16 teacher's input by weights copied from it: a 16-bit GEMM
    with fp32 accumulation and output, equal to the fp32 GEMM of the same values up to the
    summation order."""
    from megatron_tc.calibrate.readout import wide_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    w = (torch.randn(384, shape[-1], device="cuda", generator=g) * 0.05).to(dtype)
    bias = torch.randn(384, device="cuda", generator=g)
    for b in (None, bias):
        got = wide_linear(x, w, b)
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 384)
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
