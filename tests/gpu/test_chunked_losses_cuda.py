"""The chunked vocabulary losses on CUDA (torch.compile'd per-chunk kernels) == the reference.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_chunked_losses_cuda.py` (about
30-60 s, most of it inductor compiling four small kernels). bf16 logits at SmolLM2's vocabulary
(49152) over 4096 tokens: several chunks, as in a training step. Both implementations compute in
fp32; values agree to fp32 summation order, gradients (bf16, like the logits) to bf16 rounding.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from megatron_tc.parallel.chunked_losses import chunked_cross_entropy, chunked_kl  # noqa: E402
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl  # noqa: E402

VOCAB, PADDED = 49152 - 7, 49152  # 7 padding columns


def loss_and_grad(fn, logits, *args):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, *args)
    weights = torch.rand(out.shape, generator=torch.Generator(device="cuda").manual_seed(9), device="cuda")
    (out * weights).sum().backward()
    return out.detach().double(), x.grad.double()


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_kl_and_ce_match_reference_bf16(temperature):
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = (torch.randn(2, 2048, PADDED, generator=gen, device="cuda") * 3).bfloat16()
    t = (torch.randn(2, 2048, PADDED, generator=gen, device="cuda") * 3).bfloat16()
    target = torch.randint(0, VOCAB, (2, 2048), generator=gen, device="cuda")
    target[:, -1] = -100
    want, want_grad = loss_and_grad(vocab_parallel_kl, s, t, VOCAB, temperature)
    got, got_grad = loss_and_grad(chunked_kl, s, t, VOCAB, temperature)
    assert rel(got, want) < 1e-5 and rel(got_grad, want_grad) < 1e-2, (rel(got, want), rel(got_grad, want_grad))
    assert got_grad[..., VOCAB:].abs().max() == 0
    want, want_grad = loss_and_grad(vocab_parallel_cross_entropy, s, target, VOCAB)
    got, got_grad = loss_and_grad(chunked_cross_entropy, s, target, VOCAB)
    assert rel(got, want) < 1e-5 and rel(got_grad, want_grad) < 1e-2, (rel(got, want), rel(got_grad, want_grad))
