"""Worker for the tensor-parallel test of the chunked vocabulary losses (spawned gloo ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tc.parallel import chunked_losses
from megatron_tc.parallel.chunked_losses import chunked_cross_entropy, chunked_kl
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl

PADDED = 48


def _full(seed: int) -> torch.Tensor:
    return torch.randn(3, 5, PADDED, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def _loss_and_grad(fn, logits, *args):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, *args)
    (out * torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return out.detach(), x.grad


def chunked_equals_single_device(rank: int, world_size: int) -> None:
    """Each rank holds a vocabulary shard; per-token values equal the single-device reference on
    every rank and each shard's gradient is its slice of the full gradient. vocab 20 of 48 puts
    rank 1 on padding only (no real column); 40 of 48 gives both ranks real columns."""
    chunked_losses.CHUNK_ELEMENTS = 2 * PADDED  # several chunks of 2 rows per rank
    group = dist.group.WORLD
    width = PADDED // world_size
    cols = slice(rank * width, (rank + 1) * width)
    for vocab in (40, 20):
        s, t = _full(1), _full(2)
        target = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(3))
        target[1, 2] = -100
        cases = [(chunked_kl, vocab_parallel_kl, (t, vocab, 1.5), (t[..., cols], vocab, 1.5, group)),
                 (chunked_cross_entropy, vocab_parallel_cross_entropy, (target, vocab), (target, vocab, -100, group))]
        for fn, ref, full_args, shard_args in cases:
            want, want_grad = _loss_and_grad(ref, s, *full_args)
            got, got_grad = _loss_and_grad(fn, s[..., cols], *shard_args)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{fn.__name__} vocab {vocab}")
            torch.testing.assert_close(got_grad, want_grad[..., cols], rtol=1e-12, atol=1e-12,
                                       msg=f"{fn.__name__} grad vocab {vocab}")
