"""Vocab-parallel losses: KL(teacher || student) and cross-entropy on vocabulary shards.

Under tensor parallelism the LM head is column-parallel: rank r of the TP group holds the logits of
vocabulary rows [r * V_local, (r + 1) * V_local) of the padded vocabulary. The losses below work
on those shards directly: each softmax normalizer is a max and a sum all-reduced over the TP group,
and the per-token results are summed over it; the full [tokens, vocab] logits are never gathered.
Rows at or beyond the true `vocab_size` (padding) are excluded from every softmax and get zero
gradient. With `tp_group=None` the same functions compute the plain single-device losses.

Both are custom autograd functions with closed-form backward passes:
  KL(p_t || p_s) with p = softmax(z / T):  dKL/dz_s = (p_s - p_t) / T
                                           dKL/dz_t = p_t * (log p_t - log p_s - KL) / T
  CE(z, y) = logsumexp(z) - z_y:           dCE/dz   = softmax(z) - onehot(y)
The KL is *not* multiplied by T^2 (Hinton's gradient-scale correction): the caller decides.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup


# ---- small collectives (no-ops without a TP group) ----------------------------------------------
def _all_reduce(x: Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _shard_range(local_width: int, group: ProcessGroup | None) -> tuple[int, int]:
    """[start, end) of this rank's vocabulary rows in the padded vocabulary."""
    rank = dist.get_rank(group) if group is not None else 0
    return rank * local_width, (rank + 1) * local_width


def _real_columns(logits: Tensor, vocab_size: int, group: ProcessGroup | None) -> Tensor:
    """The shard's columns that are real tokens (padding rows of the vocabulary dropped)."""
    start, end = _shard_range(logits.shape[-1], group)
    keep = max(0, min(end, vocab_size) - start)
    return logits[..., :keep]


def _global_log_softmax(z: Tensor, group: ProcessGroup | None) -> Tensor:
    """log_softmax over the vocabulary spread across the group. z: [N, V_local] fp32."""
    local_max = z.max(dim=-1).values if z.shape[-1] else z.new_full(z.shape[:-1], -torch.inf)
    z_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
    shifted = z - z_max.unsqueeze(-1)
    sum_exp = _all_reduce(shifted.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
    return shifted - sum_exp.log().unsqueeze(-1)


def _fp32_or_wider(x: Tensor) -> Tensor:
    """Softmax arithmetic in at least fp32 (bf16 logits on GPU), fp64 kept for gradcheck."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _pad_grad(grad_real: Tensor, width: int) -> Tensor:
    """Put the gradient of the real columns back into a full shard (zeros on padding)."""
    if grad_real.shape[-1] == width:
        return grad_real
    full = grad_real.new_zeros(*grad_real.shape[:-1], width)
    full[..., : grad_real.shape[-1]] = grad_real
    return full


# ---- KL(teacher || student) ---------------------------------------------------------------------
class _VocabParallelKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, vocab_size: int,
                group: ProcessGroup | None) -> Tensor:
        width, dtypes = student.shape[-1], (student.dtype, teacher.dtype)
        zs = _fp32_or_wider(_real_columns(student, vocab_size, group)) / temperature
        zt = _fp32_or_wider(_real_columns(teacher, vocab_size, group)) / temperature
        log_ps, log_pt = _global_log_softmax(zs, group), _global_log_softmax(zt, group)
        p_t = log_pt.exp()
        log_ratio = log_pt - log_ps
        # 0 * log 0 = 0: a teacher probability that underflows contributes nothing
        kl = _all_reduce(torch.where(p_t > 0, p_t * log_ratio, 0.0).sum(dim=-1), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(log_ps, p_t, log_ratio, kl)
        ctx.info = (temperature, width, dtypes)
        return kl

    @staticmethod
    def backward(ctx, grad_kl: Tensor):
        log_ps, p_t, log_ratio, kl = ctx.saved_tensors
        temperature, width, (s_dtype, t_dtype) = ctx.info
        g = grad_kl.to(p_t.dtype).unsqueeze(-1) / temperature
        grad_s = grad_t = None
        if ctx.needs_input_grad[0]:
            grad_s = _pad_grad(g * (log_ps.exp() - p_t), width).to(s_dtype)
        if ctx.needs_input_grad[1]:
            grad_t = g * torch.where(p_t > 0, p_t * (log_ratio - kl.unsqueeze(-1)), 0.0)
            grad_t = _pad_grad(grad_t, width).to(t_dtype)
        return grad_s, grad_t, None, None, None


def vocab_parallel_kl(student_logits: Tensor, teacher_logits: Tensor, vocab_size: int,
                      temperature: float = 1.0, tp_group: ProcessGroup | None = None) -> Tensor:
    """Per-token KL(softmax(teacher / T) || softmax(student / T)).

    student_logits, teacher_logits: [..., V_local] this rank's vocabulary shard (V_local =
    padded_vocab_size / TP; the whole padded vocabulary when tp_group is None). Returns [...]
    (fp32, or fp64 for fp64 input), identical on every TP rank. Reduce (mask, mean) it yourself.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape (same padded vocab and TP)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelKL.apply(student_logits, teacher_logits, float(temperature), vocab_size, tp_group)


# ---- cross-entropy ------------------------------------------------------------------------------
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, vocab_size: int, ignore_index: int,
                group: ProcessGroup | None) -> Tensor:
        width, dtype = logits.shape[-1], logits.dtype
        start, _ = _shard_range(width, group)
        log_p = _global_log_softmax(_fp32_or_wider(_real_columns(logits, vocab_size, group)), group)
        valid = target != ignore_index
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < log_p.shape[-1])
        index = torch.where(mine, local_target, 0).unsqueeze(-1)
        if log_p.shape[-1]:
            picked = torch.where(mine, log_p.gather(-1, index).squeeze(-1), 0.0)
        else:  # a shard holding only padding rows
            picked = torch.zeros(target.shape, dtype=log_p.dtype, device=log_p.device)
        loss = -_all_reduce(picked, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(log_p, index, mine, valid)
        ctx.info = (width, dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        log_p, index, mine, valid = ctx.saved_tensors
        width, dtype = ctx.info
        grad = log_p.exp()
        if grad.shape[-1]:
            grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad = grad * (grad_loss.to(grad.dtype) * valid).unsqueeze(-1)
        return _pad_grad(grad, width).to(dtype), None, None, None, None


def check_ce_inputs(logits: Tensor, target: Tensor, vocab_size: int, ignore_index: int) -> None:
    """ValueError unless target is logits' shape without the vocabulary and holds ids in
    [0, vocab_size) or ignore_index."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: target must be "
                         "logits without the vocabulary dimension")
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"target ids must be in [0, {vocab_size}) or {ignore_index}; got "
                         f"{target[bad].unique()[:8].tolist()}")


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_size: int, ignore_index: int = -100,
                                 tp_group: ProcessGroup | None = None) -> Tensor:
    """Per-token cross-entropy of global token ids `target` [...] against logits [..., V_local].

    Tokens whose target is `ignore_index` get loss 0 and no gradient. Returns [...] fp32, identical
    on every TP rank.
    """
    check_ce_inputs(logits, target, vocab_size, ignore_index)
    return _VocabParallelCE.apply(logits, target, vocab_size, ignore_index, tp_group)


# ---- evaluation helpers (no autograd) ----------------------------------------------------------
@torch.no_grad()
def vocab_parallel_log_softmax(logits: Tensor, vocab_size: int, tp_group: ProcessGroup | None = None,
                               ) -> tuple[Tensor, int]:
    """(log_probs [..., V_real_local] fp32, start): the log-probabilities of this shard's real
    tokens, normalized over the whole vocabulary, and the global id of its first column."""
    real = _real_columns(logits, vocab_size, tp_group)
    return _global_log_softmax(_fp32_or_wider(real), tp_group), _shard_range(logits.shape[-1], tp_group)[0]


@torch.no_grad()
def vocab_parallel_argmax(values: Tensor, start: int, tp_group: ProcessGroup | None = None) -> Tensor:
    """Global token id [...] of the largest of `values` [..., V_local] (this shard's columns,
    starting at global id `start`); ties go to the smallest id, as torch.argmax over the full row."""
    if values.shape[-1]:
        best, index = values.max(dim=-1)
        index = index + start
    else:  # a shard of padding only
        best = values.new_full(values.shape[:-1], -torch.inf)
        index = torch.zeros(values.shape[:-1], dtype=torch.long, device=values.device)
    top = _all_reduce(best.clone(), dist.ReduceOp.MAX, tp_group)
    candidate = torch.where(best == top, index, torch.iinfo(torch.long).max)
    return _all_reduce(candidate, dist.ReduceOp.MIN, tp_group)
