"""Periodic evaluation during training: perplexity, KL(teacher || student) and top-1 agreement,
spread over data-parallel ranks, with the conventions of `megatron_tc.eval.perplexity` (every
window scored on its own; the token at t+1 predicted from positions <= t; sums in fp64). Windows
of one length go through the model `batch_size` at a time (`eval.batch_size`): one window per
forward leaves a GPU idle between hundreds of small launches.

Under ZeRO-3 a forward gathers parameters collectively, so every rank must run the same number of
forwards: windows are dealt in rounds of dp_size x batch_size, and ranks that run out repeat a
window whose scores they drop.

Under tensor parallelism the logits are vocabulary shards ([1, T, V_pad / TP]); pass `vocab_size`
and `tp_group`: log-probabilities are normalized over the TP group, per-token sums and the top-1
token are reduced over it, and the full logits are never gathered. The teacher cache then holds
this rank's shard of the teacher's log-probs. A teacher split over TP ranks scoring a whole
student (the eval stage) passes `teacher_tp_group` instead: the teacher's terms are computed on
its shards, the student's log-probs whole, and the KL on the columns of the teacher's shard.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_tc.parallel.comm import all_reduce_

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def window_rows(windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Windows ([n, T] tensors, as eval.perplexity.make_windows gives) -> rows [1, T]."""
    return [w[i:i + 1] for w in windows for i in range(w.shape[0])]


def _log_probs(logits: torch.Tensor, vocab_size: int | None = None, tp_group=None) -> tuple[torch.Tensor, int]:
    """(log-probs of this rank's real vocabulary columns, global id of its first column)."""
    if tp_group is None:
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1), 0
    from megatron_tc.parallel.losses import vocab_parallel_log_softmax

    return vocab_parallel_log_softmax(logits, vocab_size, tp_group)


def _tp_sum(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is not None:
        all_reduce_(x, group=tp_group)
    return x


def _target_log_probs(lp: torch.Tensor, start: int, targets: torch.Tensor, tp_group) -> torch.Tensor:
    """Sum over positions of log p(target) [fp64 scalar]; each target lives on one TP shard."""
    local = targets - start
    mine = (local >= 0) & (local < lp.shape[-1])
    picked = lp.gather(-1, torch.where(mine, local, 0)[:, None])[:, 0] if lp.shape[-1] else lp.new_zeros(targets.shape)
    return _tp_sum(torch.where(mine, picked, 0.0).sum(dtype=torch.float64).cpu(), tp_group)


def _top1(lp: torch.Tensor, start: int, tp_group) -> torch.Tensor:
    if tp_group is None:
        return lp.argmax(-1)
    from megatron_tc.parallel.losses import vocab_parallel_argmax

    return vocab_parallel_argmax(lp, start, tp_group)


class TeacherCache:
    """The teacher's log-probabilities of this rank's evaluation rows, kept between evaluations
    (the teacher is frozen) when they fit in `max_bytes`; else the teacher runs every time."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        # row -> (log-probs [T - 1, V_local], global id of their first column); filled by the first evaluation
        self.rows: dict[int, tuple[torch.Tensor, int]] | None = None
        self.enabled = True

    def plan(self, num_rows: int, seq_len: int, vocab: int) -> None:
        if self.rows is None and num_rows * max(seq_len - 1, 1) * vocab * 4 > self.max_bytes:
            self.enabled = False


def eval_batch_size(cfg: Any) -> int:
    """`eval.batch_size`, or the training micro-batch when unset (its logits fit by construction)."""
    return cfg.eval.batch_size or cfg.data.micro_batch_size


def forward_plan(rows: list[torch.Tensor], batch_size: int, dp_rank: int, dp_size: int) -> list[tuple[list[int], bool]]:
    """This rank's forwards as (row indices, real). Rows of one length share a forward; each length
    is dealt in rounds of dp_size x batch_size rows, so every rank runs the same number of forwards;
    a rank with no rows left in a round runs that length's first row and drops it (real False)."""
    if batch_size < 1:
        raise ValueError(f"eval batch_size={batch_size}: it is the number of windows per forward, at least 1")
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):  # first-appearance order: the same on every rank
        by_length.setdefault(row.shape[-1], []).append(i)
    plan = []
    for indices in by_length.values():
        for start in range(0, len(indices), dp_size * batch_size):
            mine = indices[start + dp_rank * batch_size: start + (dp_rank + 1) * batch_size]
            plan.append((mine, True) if mine else ([indices[0]], False))
    return plan


@torch.no_grad()
def score_rows(student: LogitsFn, teacher: LogitsFn | None, rows: list[torch.Tensor], dp_rank: int, dp_size: int,
               dp_group=None, device: torch.device | str = "cpu", cache: TeacherCache | None = None,
               vocab_size: int | None = None, tp_group=None, batch_size: int = 1,
               teacher_tp_group=None) -> dict[str, float]:
    """{"ppl", "nll", "kl", "top1_agree", "teacher_ppl", "tokens"} over `rows` (each [1, T]), run
    `batch_size` rows of one length per forward ([b, T]).

    With a `cache`, the teacher runs only in the first call; later calls reuse its log-probs.
    With `tp_group` (TP > 1) both models' logits are vocabulary shards; with `teacher_tp_group`
    only the teacher's are (the student's are whole, [b, T, vocab_size]). Either needs `vocab_size`."""
    if tp_group is not None and teacher_tp_group is not None:
        raise ValueError("score_rows: pass tp_group (both models' logits are shards) or teacher_tp_group, not both")
    t_group = tp_group if tp_group is not None else teacher_tp_group
    if t_group is not None and vocab_size is None:
        raise ValueError("score_rows with a tp_group needs vocab_size (to mask the padded vocabulary rows)")
    if not rows:
        raise ValueError("no evaluation windows: data.eval_tokens is too small for the sequence length")
    # sums: nll, kl, teacher_nll, agree, tokens
    sums = torch.zeros(5, dtype=torch.float64)
    plan = forward_plan(rows, batch_size, dp_rank, dp_size)
    cached = cache is not None and cache.enabled and cache.rows is not None
    filling = cache is not None and cache.enabled and cache.rows is None
    store: dict[int, torch.Tensor] = {}
    for n, (indices, real) in enumerate(plan):
        ids = torch.cat([rows[i] for i in indices]).to(device)
        s_logits = student(ids)
        if teacher is not None and not cached:
            t_logits = teacher(ids)
            if filling and n == 0:
                cache.plan(sum(len(ix) for ix, r in plan if r), ids.shape[1], t_logits.shape[-1])
                filling = cache.enabled
        if not real:
            continue
        for j, index in enumerate(indices):
            targets = ids[j, 1:]
            lps, start = _log_probs(s_logits[j, :-1], vocab_size, tp_group)
            sums[0] += -_target_log_probs(lps, start, targets, tp_group)
            if teacher is not None:
                lpt, t_start = cache.rows[index] if cached else _log_probs(t_logits[j, :-1], vocab_size, t_group)
                if filling:
                    store[index] = (lpt, t_start)
                # the student's log-probs on the teacher's columns (all of them unless only the teacher is split)
                lps_t = lps if t_group is tp_group else lps[..., t_start:t_start + lpt.shape[-1]]
                sums[1] += _tp_sum((lpt.exp() * (lpt - lps_t)).sum(dtype=torch.float64).cpu(), t_group)
                sums[2] += -_target_log_probs(lpt, t_start, targets, t_group)
                sums[3] += float((_top1(lps, start, tp_group) == _top1(lpt, t_start, t_group)).sum())
            sums[4] += targets.numel()
    if filling:
        cache.rows = store
    if dp_size > 1:
        all_reduce_(sums, group=dp_group)  # CPU fp64 sums: through the GPU under NCCL
    tokens = float(sums[4])
    out = {"ppl": math.exp(float(sums[0]) / tokens), "nll": float(sums[0]) / tokens, "tokens": int(tokens)}
    if teacher is not None:
        out.update(kl=float(sums[1]) / tokens, top1_agree=float(sums[3]) / tokens,
                   teacher_ppl=math.exp(float(sums[2]) / tokens))
    return out


# ---- the eval log: one JSON object per evaluation --------------------------------------------------

def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is unreliable
    return records


def truncate_jsonl(path: Path, key: str, keep_up_to: float) -> None:
    """Drop records whose `key` exceeds `keep_up_to` (a resumed run rewrites them), atomically."""
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if r.get(key, 0) <= keep_up_to]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    tmp.replace(path)
