"""Chunked gated delta rule vs the step-by-step recurrence: outputs, final states and gradients."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model.ops import gated_delta_rule

SHAPES = [  # B, T, H, Dk, Dv, chunk
    (2, 37, 3, 32, 32, 16),  # T not a multiple of the chunk
    (1, 130, 2, 64, 64, 64),  # head dim 64, three chunks with a ragged tail
    (2, 48, 4, 32, 64, 16),  # several heads, Dk != Dv, exact multiple
]


def make_inputs(b, t, h, dk, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(
        q=r(b, t, h, dk),
        k=r(b, t, h, dk),
        v=r(b, t, h, dv),
        g=-torch.rand(b, t, h, generator=gen, dtype=dtype) * 0.7,  # log decay in (-0.7, 0]
        beta=torch.rand(b, t, h, generator=gen, dtype=dtype),
        initial_state=r(b, h, dk, dv) * 0.3,
    )


def packed_doc_ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    """Random document boundaries, including one on a chunk edge and one at position 1."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, t, generator=gen) < 0.08
    starts[:, 1] = True
    starts[0, min(16, t - 1)] = True
    starts[:, 0] = False
    return starts.long().cumsum(1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(backend, inputs, doc_ids, chunk):
    leaves = {n: x.clone().requires_grad_(True) for n, x in inputs.items()}
    o, s = gated_delta_rule(
        **leaves, output_final_state=True, doc_ids=doc_ids, use_qk_l2norm=True, chunk_size=chunk, backend=backend
    )
    gen = torch.Generator().manual_seed(7)
    # cotangents drawn in fp64, then cast, so fp32 and fp64 runs see the same ones
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() + (
        s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ).sum()
    loss.backward()
    return o, s, {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunk_matches_recurrent_fp64(shape, packed):
    b, t, h, dk, dv, chunk = shape
    inputs = make_inputs(b, t, h, dk, dv)
    doc_ids = packed_doc_ids(b, t) if packed else None
    o_ref, s_ref, g_ref = run("recurrent", inputs, doc_ids, chunk)
    o, s, grads = run("chunk", inputs, doc_ids, chunk)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5
    for name in inputs:
        assert rel_err(grads[name], g_ref[name]) < 1e-5, name


def test_chunk_fp32_close_to_fp64_reference():
    inputs = make_inputs(2, 100, 2, 64, 64)
    o_ref, s_ref, g_ref = run("recurrent", inputs, None, 64)
    o, s, grads = run("chunk", {n: x.float() for n, x in inputs.items()}, None, 64)
    assert o.dtype == torch.float32
    assert rel_err(o.double(), o_ref) < 1e-4
    for name in inputs:
        assert rel_err(grads[name].double(), g_ref[name]) < 1e-4, name


def test_doc_reset_equals_separate_sequences():
    """A packed row gives the same outputs as running each document alone from a zero state."""
    inputs = make_inputs(1, 40, 2, 32, 32)
    inputs.pop("initial_state")
    doc_ids = torch.tensor([[0] * 13 + [1] * 27])
    o, _ = gated_delta_rule(**inputs, doc_ids=doc_ids, use_qk_l2norm=True, chunk_size=16, backend="chunk")
    for lo, hi in ((0, 13), (13, 40)):
        part = {n: x[:, lo:hi] for n, x in inputs.items()}
        o_part, _ = gated_delta_rule(**part, use_qk_l2norm=True, backend="recurrent")
        assert rel_err(o[:, lo:hi], o_part) < 1e-10


def test_state_carries_across_calls():
    """Running T in two calls with the state handed over equals one call (the decoding contract)."""
    inputs = make_inputs(2, 50, 2, 32, 32)
    full, s_full = gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm=True, backend="chunk", chunk_size=16)
    first = {n: (x[:, :21] if n != "initial_state" else x) for n, x in inputs.items()}
    o1, s1 = gated_delta_rule(**first, output_final_state=True, use_qk_l2norm=True, backend="chunk", chunk_size=16)
    second = {n: x[:, 21:] for n, x in inputs.items() if n != "initial_state"}
    o2, s2 = gated_delta_rule(**second, initial_state=s1, output_final_state=True, use_qk_l2norm=True, backend="recurrent")
    assert rel_err(torch.cat([o1, o2], 1), full) < 1e-10
    assert rel_err(s2, s_full) < 1e-10


def test_bad_shapes_and_backend_raise():
    inputs = make_inputs(1, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="beta must be"):
        gated_delta_rule(**{**inputs, "beta": inputs["beta"][..., :1]})
    with pytest.raises(ValueError, match="initial_state must be"):
        gated_delta_rule(**{**inputs, "initial_state": inputs["initial_state"][:, :, :8]})
    with pytest.raises(ValueError, match="backend"):
        gated_delta_rule(**inputs, backend="triton")
    with pytest.raises(ValueError, match="needs CUDA"):
        gated_delta_rule(**inputs, backend="fla_chunk")
    with pytest.raises(ValueError, match="doc_ids must have shape"):
        gated_delta_rule(**inputs, doc_ids=torch.zeros(1, 7, dtype=torch.long))
