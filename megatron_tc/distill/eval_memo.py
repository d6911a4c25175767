"""Evaluations one pipeline process has already run, kept for a later stage over the same rows.

Stage 2 scores its starting student (step 0) and its final one on the held-out rows, with the
teacher's log-probabilities cached; the eval stage then scores the same two students, from the
checkpoints stage 2 started from and wrote, with the same teacher. When both stages compute alike
(fp32 weights, eager modules, whole-vocabulary logits, the same rows, batch size and rank share),
the eval stage takes those scores and log-probabilities instead of running the forwards again.

    memo = EvalMemo()
    key = memo.rows_key(rows, batch_size, dp_rank, dp_size)
    cache = memo.teacher_cache(key)               # shared by every evaluation under this key
    memo.remember(key, checkpoint_dir, scores)    # after the checkpoint is written
    memo.recall(key, checkpoint_dir)              # -> the scores, or None
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from megatron_tc.distill.evaluation import TeacherCache


def computes_like_eval_stage(module: torch.nn.Module, tp_size: int = 1, compiled: bool = False) -> bool:
    """Whether `module` (a model, or an engine wrapping one) gives the logits the eval stage's
    freshly loaded fp32 model gives: fp32 parameters, eager, not split over tensor-parallel ranks."""
    inner = getattr(module, "module", module)
    return (tp_size == 1 and not compiled
            and all(p.dtype == torch.float32 for p in inner.parameters()))


def _checkpoint_identity(path: Path) -> tuple[str, str] | None:
    """(resolved directory, hash of its manifest): a rewritten checkpoint has another identity."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return None
    return str(Path(path).resolve()), hashlib.sha256(manifest.read_bytes()).hexdigest()


class EvalMemo:
    def __init__(self) -> None:
        self._teacher: dict[str, TeacherCache] = {}
        self._scores: dict[tuple[str, tuple[str, str]], dict[str, Any]] = {}

    @staticmethod
    def rows_key(rows: list[torch.Tensor], batch_size: int, dp_rank: int, dp_size: int) -> str:
        """What decides the forwards of `score_rows`: the rows' tokens, the batch size, this rank's share."""
        digest = hashlib.sha256()
        for row in rows:  # each [1, T]
            digest.update(str(tuple(row.shape)).encode())
            digest.update(row.to(torch.int64).contiguous().numpy().tobytes())
        return f"{digest.hexdigest()}/b{batch_size}/r{dp_rank}of{dp_size}"

    def teacher_cache(self, key: str) -> TeacherCache:
        """The fp32 whole-vocabulary teacher's log-probs for `key` (empty until an evaluation fills it)."""
        return self._teacher.setdefault(key, TeacherCache())

    def remember(self, key: str, checkpoint: Path, scores: dict[str, Any] | None) -> None:
        identity = _checkpoint_identity(checkpoint)
        if scores is not None and identity is not None:
            self._scores[(key, identity)] = dict(scores)

    def recall(self, key: str, checkpoint: Path) -> dict[str, Any] | None:
        identity = _checkpoint_identity(checkpoint)
        found = self._scores.get((key, identity)) if identity is not None else None
        return dict(found) if found is not None else None
