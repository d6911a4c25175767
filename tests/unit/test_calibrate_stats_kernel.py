"""Sweep 1's fused Triton kernel (`calibrate.moments_triton`) == the PyTorch chunks, on CPU.

The parity tests run the kernel in Triton's interpreter, with triton importable, which the
project's environment never has: tests/unit/test_kernels_interpreted.py runs this file in a
subprocess with the triton that tools/setup_env.sh keeps apart (its docstring has the command;
numpy < 2.4 there: the 3.6 interpreter converts 1-element arrays to scalars, an error from numpy
2.4). With triton importable, `test_kernel_compiles_for_sm90_without_a_gpu` also compiles the bf16 kernel
to an sm_90 cubin offline (a subprocess without TRITON_INTERPRET). The dispatch tests run
everywhere. The GPU twin is tests/gpu/test_stats_kernel_cuda.py.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_tc.calibrate import moments
from megatron_tc.calibrate.moments import STATS_KERNEL_ENV, attention_sums, use_stats_kernel

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(
    not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and TRITON_INTERPRET=1 (see the module docstring)",
)


def make_case(b, hq, hkv, t, d, docs, logit_scale, dtype, seed=0):
    """q/k/v [B, H, T, D] (q scaled: large logit_scale = peaked rows with a dominant sink),
    o_weight and doc_ids (packed documents of unequal lengths, one ending mid-block)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=gen) * logit_scale
    k, v = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)
    o_weight = torch.randn(3 * d, hq * d, generator=gen)
    doc_ids = None
    if docs:
        doc_ids = torch.zeros(b, t, dtype=torch.long)
        doc_ids[:, t // 3:] = 1
        doc_ids[-1, t // 2 + 1:] = 2
        doc_ids[-1, t - 3:] = 3
    return q.to(dtype), k.to(dtype), v.to(dtype), o_weight, doc_ids


def both_paths(monkeypatch, q, k, v, o_weight, doc_ids, window, chunk=32):
    out = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv(STATS_KERNEL_ENV, mode)
        out[mode] = attention_sums(q, k, v, 0.3, o_weight, doc_ids, window, chunk)
    return out["reference"], out["triton"]


def worst_rel(got: dict, ref: dict) -> tuple[float, str]:
    """Largest per-key error relative to the key's largest magnitude (over heads / entries)."""
    return max((float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-30)), key) for key in ref)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, docs, window, logit_scale",
    [
        ((1, 2, 1, 40, 16), False, None, 1.0),  # T < one block; GQA 2:1
        ((1, 2, 1, 200, 16), False, None, 1.0),  # causal rows: key blocks seen whole, without masks
        ((2, 4, 2, 150, 16), True, None, 2.0),  # T not a multiple of 64, packed docs, 3 key blocks
        ((2, 4, 2, 150, 24), True, 20, 2.0),  # sliding window hides the sink; D not a power of 2
        ((1, 3, 3, 90, 16), True, None, 8.0),  # peaked rows: the sink's mass near 1 (fp32 p underflows)
    ],
)
def test_kernel_matches_pytorch_chunks(monkeypatch, shape, docs, window, logit_scale, dtype):
    q, k, v, o_weight, doc_ids = make_case(*shape, docs, logit_scale, dtype)
    (ref, y_ref), (got, y_got) = both_paths(monkeypatch, q, k, v, o_weight, doc_ids, window)
    # fp32: summation order only; bf16 operands: the kernel's p split in two bf16 halves (~16 bits)
    tol = 1e-5 if dtype == torch.float32 else 2e-5
    err, key = worst_rel(got, ref)
    assert err < tol, f"{key}: {err:.2e}"
    assert torch.allclose(y_got, y_ref, rtol=0, atol=tol * float(y_ref.abs().max()))


@interpreter
def test_kernel_rows_rescale_across_key_blocks(monkeypatch):
    """Small blocks (16): every row's max moves several times (the online rescaling), and a
    query block whose documents start late skips the key blocks before them."""
    from megatron_tc.calibrate import moments_triton

    real = moments_triton.attention_closed
    monkeypatch.setattr(moments_triton, "attention_closed",
                        lambda *a, **kw: real(*a, block_m=16, block_n=16))
    q, k, v, o_weight, doc_ids = make_case(2, 2, 1, 77, 16, True, 3.0, torch.float32, seed=3)
    # increasing logits along the keys: the running max grows block after block
    k = k + torch.linspace(0, 3, 77)[None, None, :, None]
    (ref, y_ref), (got, y_got) = both_paths(monkeypatch, q, k, v, o_weight, doc_ids, None)
    err, key = worst_rel(got, ref)
    assert err < 1e-5, f"{key}: {err:.2e}"
    assert torch.allclose(y_got, y_ref, rtol=0, atol=1e-5 * float(y_ref.abs().max()))


def test_dispatch_env(monkeypatch):
    q = torch.zeros(1, 1, 2, 4)
    monkeypatch.setenv(STATS_KERNEL_ENV, "reference")
    assert not use_stats_kernel(q)
    monkeypatch.setenv(STATS_KERNEL_ENV, "auto")
    assert not use_stats_kernel(q)  # CPU tensors: the PyTorch path
    monkeypatch.setenv(STATS_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="auto, triton or reference"):
        use_stats_kernel(q)


def test_forcing_the_kernel_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(moments, "_triton_importable", lambda: False)
    monkeypatch.setenv(STATS_KERNEL_ENV, "triton")
    with pytest.raises(ImportError, match="needs the triton package"):
        use_stats_kernel(torch.zeros(1, 1, 2, 4))


def test_documents_are_contiguous():
    from megatron_tc.calibrate.moments import documents_are_contiguous

    assert documents_are_contiguous(torch.tensor([[0, 0, 1, 1, 2], [0, 0, 0, 0, 0]]))
    assert documents_are_contiguous(torch.tensor([[7, 7, 3, 3, 5]]))  # distinct runs, any labels
    assert not documents_are_contiguous(torch.tensor([[0, 0, 1, 1, 0]]))  # id 0 returns
    doc_ids = torch.tensor([[0, 0, 1, 1, 2]])
    assert documents_are_contiguous(doc_ids)
    doc_ids[0, -1] = 0  # the cached answer follows in-place changes
    assert not documents_are_contiguous(doc_ids)


def test_forced_kernel_refuses_documents_split_in_runs(monkeypatch):
    monkeypatch.setattr(moments, "_triton_importable", lambda: True)
    monkeypatch.setenv(STATS_KERNEL_ENV, "triton")
    q, k, v, o_weight, _ = make_case(1, 2, 1, 8, 4, False, 1.0, torch.float32)
    doc_ids = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]])
    with pytest.raises(ValueError, match="one contiguous run"):
        attention_sums(q, k, v, 0.3, o_weight, doc_ids)


COMPILE_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_tc.calibrate.moments_triton import _rows_kernel

ints = ["T", "H", "GROUP", "D", "PLANE", "sqb", "sqh", "sqt", "skb", "skh", "skt", "svb", "svh", "svt", "sbb", "sbh"]
consts = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, HI_LO=True, IEEE=False, UPCAST=False)
signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KBAR": "*fp32", "VBAR": "*fp32", "LO": "*i32", "SINK": "*i32", "OUT_ROWS": "*fp32",
             "OUT_Y": "*fp32", "scale": "fp32", **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
kernel = triton.compile(ASTSource(fn=_rows_kernel, signature=signature, constexprs=consts),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
assert "wgmma" in kernel.asm["ptx"], "expected Hopper tensor-core MMAs"
print("cubin bytes", len(kernel.asm["cubin"]))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (see the module docstring)")
def test_kernel_compiles_for_sm90_without_a_gpu():
    """The bf16 production configuration through Triton's whole pipeline to an sm_90 cubin
    (frontend, layouts, ptxas), offline: catches what the interpreter does not see."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cubin bytes" in out.stdout
