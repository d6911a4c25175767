"""KL(teacher || student) and cross-entropy over the vocabulary, computed a chunk of tokens at a time.

Same values and gradients as `losses.vocab_parallel_kl` / `vocab_parallel_cross_entropy` (the
reference formulas, kept for parity tests and `tools/bench/train.py --variants reference`), but:
- no [tokens, vocab] fp32 tensor of the whole batch is ever made: the bf16 logits are read a chunk
  of rows at a time (CHUNK_ELEMENTS logits) and upcast inside the chunk only;
- only per-token statistics are saved for backward ([tokens] fp32: the student's and teacher's
  log-normalizers), and the backward recomputes the probabilities chunk by chunk, writing the
  gradient straight into one tensor of the student's dtype;
- the per-chunk arithmetic is a few functions that torch.compile fuses into one reduction and one
  elementwise kernel on CUDA (the reference runs ~20 separate full-size fp32 passes; the profile in
  docs/benchmarks.md measured them at ~20% of a SmolLM2 training step).

With p = softmax(z / T) and, per token, m = max(z / T) (all-reduced over the TP group), the sums
S = sum_v exp(z/T - m) and C = sum_v exp(zt/T - m_t) (zt - zs) / T, also all-reduced:
    lse = m + log S,   KL = C / S_t - lse_t + lse_s,
    dKL/dzs = (exp(zs/T - lse_s) - exp(zt/T - lse_t)) / T.
A teacher probability that underflows (or a -inf teacher logit) contributes nothing, as in the
reference. Tensor-parallel shards work as in `losses`: padding rows beyond `vocab_size` are
dropped, reductions go over the group, the returned per-token values are identical on every rank.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_tc.model.fused import with_eager_fallback

from .losses import ProcessGroup, _all_reduce, check_ce_inputs, _fp32_or_wider, _real_columns, _shard_range

# logits per chunk: 64M (e.g. 1365 tokens at vocabulary 49152). Compiled (CUDA), a chunk's fp32
# values live in registers only; eager (CPU, fallback) each fp32 temporary is 256 MiB. Fewer,
# larger chunks keep the host's per-chunk launches (about ten) far below the GPU time.
CHUNK_ELEMENTS = 1 << 26


# ---- per-chunk arithmetic (compiled on CUDA) ------------------------------------------------------
def _kl_sums(zs: Tensor, zt: Tensor, m_s: Tensor, m_t: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor]:
    """zs, zt: [r, V] logits (any float dtype); m_s, m_t: [r] maxima of z * inv_t (compute dtype).
    Returns the local sums (S_s, S_t, C) [r] in the compute dtype of m_s."""
    dtype = m_s.dtype
    ys, yt = zs.to(dtype) * inv_t, zt.to(dtype) * inv_t
    e_t = torch.exp(yt - m_t[:, None])
    s_s = torch.exp(ys - m_s[:, None]).sum(-1)
    cross = torch.where(e_t > 0, e_t * (yt - ys), 0.0).sum(-1)
    return s_s, e_t.sum(-1), cross


def _kl_grad(zs: Tensor, zt: Tensor, lse_s: Tensor, lse_t: Tensor, scale: Tensor, inv_t: float,
             out_dtype: torch.dtype) -> Tensor:
    """(softmax(zs/T) - softmax(zt/T)) * scale[:, None] in out_dtype; scale = dKL/T per row."""
    dtype = lse_s.dtype
    p_s = torch.exp(zs.to(dtype) * inv_t - lse_s[:, None])
    p_t = torch.exp(zt.to(dtype) * inv_t - lse_t[:, None])
    return ((p_s - p_t) * scale[:, None]).to(out_dtype)


def _scaled(z: Tensor, dtype: torch.dtype, inv_t: float) -> Tensor:
    """z * inv_t in `dtype`; z itself when that changes nothing (no copy)."""
    return z if z.dtype == dtype and inv_t == 1.0 else z.to(dtype) * inv_t


def _kl_sums_lean(zs: Tensor, zt: Tensor, m_s: Tensor, m_t: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor]:
    """`_kl_sums` for eager runs (CPU): the same operations, bit for bit, on two [r, V] temporaries
    updated in place. Unfused, each fresh temporary is another pass and, on a CPU, new pages."""
    dtype = m_s.dtype
    ys, yt = _scaled(zs, dtype, inv_t), _scaled(zt, dtype, inv_t)
    e_t = torch.sub(yt, m_t[:, None]).exp_()
    s_t = e_t.sum(-1)
    cross = torch.sub(yt, ys).mul_(e_t)
    cross = cross.masked_fill_((e_t > 0).logical_not_(), 0.0).sum(-1)  # as where(e_t > 0, ..., 0)
    s_s = torch.sub(ys, m_s[:, None], out=e_t).exp_().sum(-1)
    return s_s, s_t, cross


def _kl_grad_lean(out: Tensor, zs: Tensor, zt: Tensor, lse_s: Tensor, lse_t: Tensor, scale: Tensor,
                  inv_t: float) -> None:
    """`_kl_grad` for eager runs (CPU), written into `out` [r, V] with one temporary (bit for bit)."""
    dtype = lse_s.dtype
    p_s = out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype, device=out.device)
    torch.sub(_scaled(zs, dtype, inv_t), lse_s[:, None], out=p_s).exp_()
    p_t = torch.sub(_scaled(zt, dtype, inv_t), lse_t[:, None]).exp_()
    p_s.sub_(p_t).mul_(scale[:, None])
    if p_s is not out:
        out.copy_(p_s)


def _ce_sum(z: Tensor, m: Tensor) -> Tensor:
    return torch.exp(z.to(m.dtype) - m[:, None]).sum(-1)


def _ce_grad(z: Tensor, lse: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """softmax(z) * scale[:, None] (the one-hot part is subtracted by the caller)."""
    return (torch.exp(z.to(lse.dtype) - lse[:, None]) * scale[:, None]).to(out_dtype)


_COMPILED: dict[str, object] = {}


def _kernel(name: str, fn, on_cuda: bool, eager=None):
    """torch.compile(fn) (cached) on CUDA; on CPU, `eager` (its in-place twin) or fn itself.
    MEGATRON_TC_COMPILE_LOSS=0: never compile; =force: compile on CPU too (tests of the compiled path)."""
    mode = os.environ.get("MEGATRON_TC_COMPILE_LOSS", "1")
    if mode == "0" or (not on_cuda and mode != "force"):
        return eager if eager is not None else fn
    if name not in _COMPILED:
        _COMPILED[name] = with_eager_fallback(torch.compile(fn, dynamic=False, fullgraph=True), fn,
                                             f"the chunked loss {name}")
    return _COMPILED[name]


def _rows_per_chunk(width: int, n: int) -> int:
    rows = max(1, CHUNK_ELEMENTS // max(width, 1))
    if rows >= n:
        return max(n, 1)
    chunks = -(-n // rows)  # equal chunks: one compiled shape instead of two
    return -(-n // chunks)


def _row_max(z: Tensor, inv_t: float, dtype: torch.dtype, group: ProcessGroup | None) -> Tensor:
    """max over the (sharded) vocabulary of z * inv_t, [r] in `dtype` (exact: max then scale)."""
    local = z.amax(dim=-1).to(dtype) * inv_t if z.shape[-1] else z.new_full(z.shape[:-1], -torch.inf, dtype=dtype)
    return _all_reduce(local, dist.ReduceOp.MAX, group)


# ---- KL(teacher || student) ---------------------------------------------------------------------
class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, vocab_size: int,
                group: ProcessGroup | None) -> Tensor:
        width, shape = student.shape[-1], student.shape[:-1]
        zs_all = _real_columns(student.reshape(-1, width), vocab_size, group)
        zt_all = _real_columns(teacher.reshape(-1, width), vocab_size, group)
        n, dtype = zs_all.shape[0], _fp32_or_wider(student[..., :0]).dtype
        inv_t = 1.0 / temperature
        sums = _kernel("kl_sums", _kl_sums, student.is_cuda, _kl_sums_lean)
        lse_s, lse_t, kl = (torch.empty(n, dtype=dtype, device=student.device) for _ in range(3))
        rows = _rows_per_chunk(width, n)
        for a in range(0, n, rows):
            zs, zt = zs_all[a:a + rows], zt_all[a:a + rows]
            m_s, m_t = _row_max(zs, inv_t, dtype, group), _row_max(zt, inv_t, dtype, group)
            if zs.shape[-1]:
                s_s, s_t, cross = sums(zs, zt, m_s, m_t, inv_t)
            else:  # a shard holding only padding rows
                s_s = s_t = cross = torch.zeros_like(m_s)
            s_s, s_t, cross = _all_reduce(torch.stack([s_s, s_t, cross]), dist.ReduceOp.SUM, group)
            lse_s[a:a + rows], lse_t[a:a + rows] = m_s + s_s.log(), m_t + s_t.log()
            kl[a:a + rows] = cross / s_t - lse_t[a:a + rows] + lse_s[a:a + rows]
        ctx.save_for_backward(student, teacher, lse_s, lse_t)
        ctx.info = (temperature, vocab_size, group)
        return kl.view(shape)

    @staticmethod
    def backward(ctx, grad_kl: Tensor):
        student, teacher, lse_s, lse_t = ctx.saved_tensors
        temperature, vocab_size, group = ctx.info
        width = student.shape[-1]
        zs_all = _real_columns(student.reshape(-1, width), vocab_size, group)
        zt_all = _real_columns(teacher.reshape(-1, width), vocab_size, group)
        n, real = zs_all.shape
        scale = grad_kl.reshape(-1).to(lse_s.dtype) / temperature
        grad = torch.empty((n, width), dtype=student.dtype, device=student.device)
        if real < width:
            grad[:, real:] = 0
        kernel = _kernel("kl_grad", _kl_grad, student.is_cuda, _kl_grad_lean)
        rows = _rows_per_chunk(width, n)
        for a in range(0, n, rows):
            if not real:
                continue
            args = (zs_all[a:a + rows], zt_all[a:a + rows], lse_s[a:a + rows], lse_t[a:a + rows], scale[a:a + rows],
                    1.0 / temperature)
            if kernel is _kl_grad_lean:
                kernel(grad[a:a + rows, :real], *args)
            else:
                grad[a:a + rows, :real] = kernel(*args, student.dtype)
        return grad.view(student.shape), None, None, None, None


def chunked_kl(student_logits: Tensor, teacher_logits: Tensor, vocab_size: int, temperature: float = 1.0,
               tp_group: ProcessGroup | None = None) -> Tensor:
    """Per-token KL(softmax(teacher / T) || softmax(student / T)) [...], as `losses.vocab_parallel_kl`.

    student_logits, teacher_logits: [..., V_local] (this rank's vocabulary shard). The teacher gets
    no gradient (a teacher that requires one goes through the reference function)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape (same padded vocab and TP)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher_logits.requires_grad and torch.is_grad_enabled():
        from .losses import vocab_parallel_kl

        return vocab_parallel_kl(student_logits, teacher_logits, vocab_size, temperature, tp_group)
    return _ChunkedKL.apply(student_logits, teacher_logits, float(temperature), vocab_size, tp_group)


# ---- cross-entropy ------------------------------------------------------------------------------
class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, vocab_size: int, ignore_index: int,
                group: ProcessGroup | None) -> Tensor:
        width, shape = logits.shape[-1], logits.shape[:-1]
        z_all = _real_columns(logits.reshape(-1, width), vocab_size, group)
        n, real = z_all.shape
        dtype = _fp32_or_wider(logits[..., :0]).dtype
        target = target.reshape(-1)
        start, _ = _shard_range(width, group)
        valid = target != ignore_index
        local = target - start
        mine = valid & (local >= 0) & (local < real)
        index = torch.where(mine, local, 0)
        picked = torch.zeros(n, dtype=dtype, device=logits.device)
        if real:
            picked = torch.where(mine, z_all.gather(-1, index[:, None]).squeeze(-1).to(dtype), 0.0)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        sums = _kernel("ce_sum", _ce_sum, logits.is_cuda)
        rows = _rows_per_chunk(width, n)
        for a in range(0, n, rows):
            z = z_all[a:a + rows]
            m = _row_max(z, 1.0, dtype, group)
            s = sums(z, m) if real else torch.zeros_like(m)
            lse[a:a + rows] = m + _all_reduce(s, dist.ReduceOp.SUM, group).log()
        loss = torch.where(valid, lse - _all_reduce(picked, dist.ReduceOp.SUM, group), 0.0)
        ctx.save_for_backward(logits, lse, index, mine, valid)
        ctx.info = (vocab_size, group)
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, lse, index, mine, valid = ctx.saved_tensors
        vocab_size, group = ctx.info
        width = logits.shape[-1]
        z_all = _real_columns(logits.reshape(-1, width), vocab_size, group)
        n, real = z_all.shape
        scale = grad_loss.reshape(-1).to(lse.dtype) * valid
        grad = torch.empty((n, width), dtype=logits.dtype, device=logits.device)
        if real < width:
            grad[:, real:] = 0
        kernel = _kernel("ce_grad", _ce_grad, logits.is_cuda)
        rows = _rows_per_chunk(width, n)
        for a in range(0, n, rows):
            if real:
                grad[a:a + rows, :real] = kernel(z_all[a:a + rows], lse[a:a + rows], scale[a:a + rows], logits.dtype)
        if real:  # at the target: (p_y - 1) * scale in the compute dtype, rounded once like the rest
            p_y = torch.exp(z_all.gather(-1, index[:, None]).squeeze(-1).to(lse.dtype) - lse)
            at = ((p_y - mine.to(lse.dtype)) * scale).to(grad.dtype)
            grad.scatter_(-1, index[:, None], torch.where(mine, at, grad.gather(-1, index[:, None]).squeeze(-1))[:, None])
        return grad.view(logits.shape), None, None, None, None


def chunked_cross_entropy(logits: Tensor, target: Tensor, vocab_size: int, ignore_index: int = -100,
                          tp_group: ProcessGroup | None = None) -> Tensor:
    """Per-token cross-entropy [...], as `losses.vocab_parallel_cross_entropy` (same checks)."""
    check_ce_inputs(logits, target, vocab_size, ignore_index)
    return _ChunkedCE.apply(logits, target, vocab_size, ignore_index, tp_group)
