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
    """All weights together within TOL (relative), and every tensor within 20 x TOL.

    Per tensor, fp32 after a few AdamW steps cannot promise 1e-5: a tensor that starts at zero
    (b_proj.bias) holds nothing but Adam updates, and Adam turns reduction-order rounding of
    near-zero gradients into update differences (measured: 1.2e-5 on such a bias; on the key bias
    of tests/unit/test_pretrain.py's TP=2 run, whose gradients are small, 8.8e-5 with PyTorch's
    single-tensor AdamW and 1.06e-4 with the fused one, the same update rounded otherwise)."""
    assert sorted(got) == sorted(want), f"{what}: different tensor names"
    err = rel_err(torch.cat([got[k].flatten() for k in sorted(want)]), torch.cat([want[k].flatten() for k in sorted(want)]))
    assert err <= TOL, f"{what}: all tensors together, relative error {err:.3g} > {TOL:g}"
    for name in sorted(want):
        assert_close(got[name], want[name], f"{what}: {name}", 20 * TOL)


# ---- device / precision (the same checks on CPU-gloo and on CUDA-NCCL) -------------------------
def place(model: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """`model` in `dtype` on `device`. Models are always built on the CPU first (same seed, same
    weights on every device); on CUDA the GDN op is the pure-PyTorch 'chunk' kernel, so parity
    tests do not wait for fla's Triton compilation (fla has its own tests in tests/gpu)."""
    model = model.to(device=device, dtype=dtype)
    if torch.device(device).type == "cuda":
        model.set_gdn_backend("chunk")
    return model


def on(device: str, data):
    """batches(...) (nested lists/tuples of tensors) moved to `device`."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    return type(data)(on(device, x) for x in data)


class ReferenceAdamW:
    """The single-process optimizer the DeepSpeed runs are compared with: torch AdamW plus global
    gradient-norm clipping; for bf16 parameters it keeps fp32 master weights and fp32 gradients, as
    DeepSpeed's bf16 optimizers do (AdamW on bf16 weights would lose most updates to rounding)."""

    def __init__(self, params, lr: float, clip: float, betas=(0.9, 0.95), eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.mixed = any(p.dtype == torch.bfloat16 for p in self.params)
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params] if self.mixed else self.params
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        self.clip = clip

    def step(self) -> float:
        """Clip, step, zero the gradients; returns the gradient norm before clipping."""
        if self.mixed:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, self.clip)) if self.clip else 0.0
        self.opt.step()
        self.opt.zero_grad()
        if self.mixed:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
                    p.grad = None
        return norm


# Below what the low-precision run can resolve, an error ratio means nothing: the floor.
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float64: 1e-9}


def assert_as_accurate(got: torch.Tensor, single: torch.Tensor, exact: torch.Tensor, what: str,
                       dtype: torch.dtype, floor: float | None = None, ratio: float = 2.0) -> float:
    """The parallel result `got` is at most `ratio` times as far from the fp64 result `exact` as
    the single-device result `single` of the same precision is, plus a floor: rel(got, exact) <=
    ratio x rel(single, exact) + floor. Sharding/reduction bugs give errors of order 1e-1..1;
    rounding differences of the same precision stay near the single-device error. Returns the
    ratio of the two errors (for logs)."""
    assert got.shape == single.shape == exact.shape, f"{what}: shapes {got.shape}, {single.shape}, {exact.shape}"
    floor = FLOOR[dtype] if floor is None else floor
    err, base = rel_err(got, exact), rel_err(single, exact)
    assert err <= ratio * base + floor, (f"{what} ({dtype}): parallel error vs fp64 {err:.3g} > {ratio:g} x "
                                         f"single-device error {base:.3g} + {floor:g}")
    return err / base if base else 0.0


def assert_no_live_engines() -> None:
    """Every DeepSpeed engine of this process has been released (`release_engine`): none survives
    a full garbage collection."""
    from megatron_tc.parallel.deepspeed_engine import live_engines

    alive = [type(o).__name__ for o in live_engines()]
    assert not alive, f"DeepSpeed engines still alive after release: {alive}"
