"""Shared pieces of the parallel tests: tiny hybrid architectures and a relative-error check."""
from __future__ import annotations

import torch

from megatron_tc.model import ArchConfig, pad_vocab

VOCAB = 100
TOL = 1e-5


def tiny_arch(pattern: str = "AG|GA", tp: int = 1, **overrides) -> ArchConfig:
    """4 layers, GQA (4 query heads, 2 KV heads), both layer kinds; vocab padded for `tp`."""
    fields = dict(family="qwen3", vocab_size=VOCAB, padded_vocab_size=pad_vocab(VOCAB, tp), hidden_size=32,
                  num_layers=len(pattern.replace("|", "")), num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64, layer_pattern=pattern, gdn_chunk_size=8)
    fields.update(overrides)
    return ArchConfig(**fields)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (0 when both are 0)."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale else diff


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def batches(steps: int, micro: int, batch: int, seq: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """steps x micro-batches of (input_ids [batch, seq], labels [batch, seq]), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
             for _ in range(micro)] for _ in range(steps)]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """All weights together within TOL (relative), and every tensor within 10 x TOL.

    Per tensor, fp32 after a few AdamW steps cannot promise 1e-5: a tensor that starts at zero
    (b_proj.bias) holds nothing but Adam updates, and Adam turns reduction-order rounding of
    near-zero gradients into update differences (measured: 1.2e-5 on such a bias)."""
    assert sorted(got) == sorted(want), f"{what}: different tensor names"
    err = rel_err(torch.cat([got[k].flatten() for k in sorted(want)]), torch.cat([want[k].flatten() for k in sorted(want)]))
    assert err <= TOL, f"{what}: all tensors together, relative error {err:.3g} > {TOL:g}"
    for name in sorted(want):
        assert_close(got[name], want[name], f"{what}: {name}", 10 * TOL)
