"""Chunked KL / CE (megatron_tc.parallel.chunked_losses) == the reference formulas of
megatron_tc.parallel.losses: values and gradients, over several uneven chunks, with vocabulary
padding, temperatures, ignored targets, -inf teacher logits, fp64 / fp32 / bf16 inputs."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.distill.losses import LossWeights, distill_loss
from megatron_tc.parallel import chunked_losses
from megatron_tc.parallel.chunked_losses import chunked_cross_entropy, chunked_kl
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl

VOCAB, WIDTH = 50, 56  # 6 padding columns


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """3 rows per chunk at WIDTH columns: 5 chunks of 3, 3, 3, 3, 2 rows for 14 tokens... made equal."""
    monkeypatch.setattr(chunked_losses, "CHUNK_ELEMENTS", 3 * WIDTH)


def logits(dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 7, WIDTH, generator=gen, dtype=torch.float64) * scale).to(dtype)


def grads_of(fn, student, *args):
    x = student.detach().clone().requires_grad_(True)
    out = fn(x, *args)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64).view(out.shape)
    (out.double() * weights).sum().backward()
    return out.detach(), x.grad


def test_rows_per_chunk_splits_evenly():
    assert chunked_losses._rows_per_chunk(WIDTH, 14) == 3  # ceil(14 / 3) = 5 chunks -> 3 rows each
    assert chunked_losses._rows_per_chunk(WIDTH, 2) == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_eager_in_place_kl_arithmetic_equals_the_compiled_form_bit_for_bit(dtype, temperature):
    """CPU runs the in-place twins of the per-chunk functions torch.compile fuses on CUDA."""
    inv_t = 1.0 / temperature
    zs, zt = logits(dtype, 5).view(14, WIDTH), logits(dtype, 6).view(14, WIDTH)
    zt[0, :4] = -torch.inf
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    m_s, m_t = zs.amax(-1).to(compute) * inv_t, zt.amax(-1).to(compute) * inv_t
    sums = chunked_losses._kl_sums(zs, zt, m_s, m_t, inv_t)
    for got, want in zip(chunked_losses._kl_sums_lean(zs, zt, m_s, m_t, inv_t), sums):
        assert torch.equal(got, want)
    lse_s, lse_t = m_s + sums[0].log(), m_t + sums[1].log()
    scale = torch.linspace(0.5, 1.5, 14, dtype=compute)
    want = chunked_losses._kl_grad(zs, zt, lse_s, lse_t, scale, inv_t, dtype)
    got = torch.full_like(want, torch.nan)
    chunked_losses._kl_grad_lean(got, zs, zt, lse_s, lse_t, scale, inv_t)
    assert torch.equal(got, want)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["fp64", "fp32"])
def test_kl_matches_reference(dtype, tol, temperature):
    s, t = logits(dtype, 0), logits(dtype, 1)
    want, want_grad = grads_of(vocab_parallel_kl, s, t, VOCAB, temperature)
    got, got_grad = grads_of(chunked_kl, s, t, VOCAB, temperature)
    assert got.dtype == want.dtype and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol)
    assert got_grad[..., VOCAB:].abs().max() == 0  # padding columns: no gradient


def test_kl_bf16_logits_match_reference_to_rounding():
    """bf16 logits (the GPU case): both compute in fp32; gradients equal up to bf16 rounding."""
    s, t = logits(torch.bfloat16, 2), logits(torch.bfloat16, 3)
    want, want_grad = grads_of(vocab_parallel_kl, s, t, VOCAB, 1.0)
    got, got_grad = grads_of(chunked_kl, s, t, VOCAB, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-5)


def test_kl_minus_inf_teacher_logits_contribute_nothing():
    s, t = logits(torch.float64, 4), logits(torch.float64, 5)
    t[..., :10] = -torch.inf
    want, want_grad = grads_of(vocab_parallel_kl, s, t, VOCAB, 1.0)
    got, got_grad = grads_of(chunked_kl, s, t, VOCAB, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def test_kl_teacher_requiring_grad_uses_the_reference_gradient():
    s, t = logits(torch.float64, 6), logits(torch.float64, 7).requires_grad_(True)
    chunked_kl(s, t, VOCAB).sum().backward()
    want = t.grad.clone()
    t.grad = None
    vocab_parallel_kl(s, t, VOCAB).sum().backward()
    torch.testing.assert_close(t.grad, want)


def test_kl_gradcheck():
    s = logits(torch.float64, 8)[:, :3].requires_grad_(True)
    t = logits(torch.float64, 9)[:, :3]
    assert torch.autograd.gradcheck(lambda x: chunked_kl(x, t, VOCAB, 1.5), (s,))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["fp64", "fp32"])
def test_cross_entropy_matches_reference(dtype, tol):
    z = logits(dtype, 10)
    target = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(11))
    target[0, 3] = target[1, 6] = -100
    want, want_grad = grads_of(vocab_parallel_cross_entropy, z, target, VOCAB)
    got, got_grad = grads_of(chunked_cross_entropy, z, target, VOCAB)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol)
    assert got[0, 3] == 0 and got_grad[0, 3].abs().max() == 0


def test_cross_entropy_rejects_bad_targets():
    with pytest.raises(ValueError, match="target ids must be in"):
        chunked_cross_entropy(logits(torch.float32, 0), torch.full((2, 7), VOCAB), VOCAB)


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_distill_loss_chunked_equals_reference(ce_weight):
    s, t = logits(torch.float64, 12), logits(torch.float64, 13)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(14))
    doc_ids = torch.tensor([[0] * 4 + [1] * 3, [0] * 7])
    weights = LossWeights(temperature=2.0, ce_weight=ce_weight)
    out = {}
    for impl in ("reference", "chunked"):
        x = s.clone().requires_grad_(True)
        loss, parts = distill_loss(x, t, ids, VOCAB, weights, doc_ids=doc_ids, impl=impl)
        loss.backward()
        out[impl] = (loss.detach(), parts, x.grad)
    torch.testing.assert_close(out["chunked"][0], out["reference"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["chunked"][2], out["reference"][2], rtol=1e-12, atol=1e-12)
    assert out["chunked"][1].keys() == out["reference"][1].keys()
    with pytest.raises(ValueError, match="impl"):
        distill_loss(s, t, ids, VOCAB, weights, impl="fast")


def test_a_failing_compile_falls_back_to_eager_with_a_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no triton here")
        return run

    monkeypatch.setattr(chunked_losses, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setenv("MEGATRON_TC_COMPILE_LOSS", "force")
    s, t = logits(torch.float64, 15), logits(torch.float64, 16)
    want, want_grad = grads_of(vocab_parallel_kl, s, t, VOCAB, 1.0)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        got, got_grad = grads_of(chunked_kl, s, t, VOCAB, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
