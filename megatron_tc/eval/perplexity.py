"""Perplexity, KL(teacher || student) and top-1 agreement over a text file.

Convention (the same for every model of one teacher, so numbers are comparable):
- The text is tokenized as one string, without special tokens, and the first `max_tokens` tokens
  are kept.
- Without BOS (the teacher's tokenizer adds none; `megatron_tc.data.bos`): those tokens are cut into
  non-overlapping windows of `seq_len` tokens; a last shorter window is scored too if it has at
  least 2 tokens. The first token of a window has no prediction, so every token is *predicted at
  most once*, and `tokens` (the count the averages are over) is `max_tokens - number_of_windows`.
- With BOS (the teacher's tokenizer adds one, as Gemma's and Llama-3's do): every window is BOS
  followed by the next `seq_len - 1` tokens, and all of those are predicted, the first from BOS
  alone, so `tokens` is `max_tokens`; the BOS is never a target. A window whose first token already
  is a BOS (a document start in a token stream) takes `seq_len` tokens and does not score that BOS.
  This is what transformers computes with `labels=input_ids` on the same BOS-prefixed windows.
- Inside a window, the token at position t+1 is predicted from positions <= t; each window is an
  independent forward pass.
- ppl = exp(mean NLL). KL is per token: mean over predicted positions of
  sum_v p_teacher(v) * (log p_teacher(v) - log p_student(v)), in nats. top1_agree is the fraction of
  predicted positions where argmax student logits == argmax teacher logits.
- Log-softmax runs in at least fp32 (fp64 if the logits are fp64); every sum over tokens is
  accumulated in fp64.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_tc.eval.loading import LogitsFn
from megatron_tc.monitor import progress as bar


class EvalInputError(ValueError):
    """Evaluation input that cannot be scored (empty text, bad lengths, vocab mismatch)."""


@dataclass
class EvalResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token, nats
    tokens: int  # predicted tokens the means are over
    windows: int
    seq_len: int
    kl: float | None = None  # mean KL(teacher || student) per predicted token, nats
    top1_agree: float | None = None
    teacher_ppl: float | None = None  # the teacher's perplexity on the same windows
    bos: bool | None = None  # whether every window started with BOS (set by evaluate_text)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}


class _Sums:
    """fp64 running sums over predicted tokens."""

    def __init__(self) -> None:
        self.nll = torch.zeros((), dtype=torch.float64)
        self.kl = torch.zeros((), dtype=torch.float64)
        self.teacher_nll = torch.zeros((), dtype=torch.float64)
        self.agree = 0
        self.tokens = 0
        self.windows = 0


def read_text(path: str | os.PathLike, max_chars: int | None = None) -> str:
    """UTF-8 text of `path` (optionally only the first `max_chars` characters); clear errors."""
    if not os.path.isfile(path):
        raise EvalInputError(f"text file {str(path)!r} does not exist")
    with open(path, "rb") as fh:
        raw = fh.read() if max_chars is None else fh.read(4 * max_chars)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if max_chars is not None and exc.start >= len(raw) - 3:  # cut inside a multi-byte character
            text = raw[: exc.start].decode("utf-8")
        else:
            raise EvalInputError(f"{str(path)!r} is not UTF-8 (byte {exc.start}: {exc.reason}); "
                                 "convert it, e.g. with iconv -f latin1 -t utf-8") from exc
    return text if max_chars is None else text[:max_chars]


def tokenize_file(path: str | os.PathLike, tokenizer: Any, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` token ids of the file's text -> LongTensor [N], N <= max_tokens.

    Reads a growing prefix of the file so a huge corpus is not tokenized to score a few tokens.
    """
    if max_tokens < 2:
        raise EvalInputError(f"max_tokens={max_tokens}: need at least 2 tokens to predict one")
    file_chars = os.path.getsize(path) if os.path.isfile(path) else 0
    chars = 8 * max_tokens + 1024
    while True:
        text = read_text(path, max_chars=chars)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # a prefix cut may end mid-word: read until a token *follows* the last kept one
        if len(ids) > max_tokens or chars >= file_chars:
            break
        chars *= 2
    if len(ids) < 2:
        raise EvalInputError(f"{str(path)!r} yields {len(ids)} tokens; need at least 2")
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def make_windows(ids: torch.Tensor, seq_len: int, bos_id: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows: [ids [n_full, seq_len]] plus a tail [1, r] if 2 <= r < seq_len.
    With `bos_id`, every window starts with BOS (module doc)."""
    if seq_len < 2:
        raise EvalInputError(f"seq_len={seq_len}: a window needs at least 2 tokens")
    if bos_id is not None:
        return _bos_windows(ids, seq_len, bos_id)
    n_full = ids.numel() // seq_len
    out = []
    if n_full:
        out.append(ids[: n_full * seq_len].view(n_full, seq_len))
    tail = ids[n_full * seq_len:]
    if tail.numel() >= 2:
        out.append(tail.view(1, -1))
    return out


def _bos_windows(ids: torch.Tensor, seq_len: int, bos_id: int) -> list[torch.Tensor]:
    rows, pos, n = [], 0, ids.numel()
    bos = torch.tensor([bos_id], dtype=ids.dtype)
    while pos < n:
        if int(ids[pos]) == bos_id:  # the text's own BOS opens this window
            take = min(seq_len, n - pos)
            row = ids[pos:pos + take]
        else:
            take = min(seq_len - 1, n - pos)
            row = torch.cat([bos, ids[pos:pos + take]])
        pos += take
        if row.numel() >= 2:
            rows.append(row)
    full = [r for r in rows if r.numel() == seq_len]
    out = [torch.stack(full)] if full else []
    if rows and rows[-1].numel() < seq_len:
        out.append(rows[-1].view(1, -1))
    return out


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def _score_row(student: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None, sums: _Sums) -> None:
    """student/teacher [T-1, V] logits predicting targets [T-1]; adds to `sums`."""
    lps = _log_probs(student)
    nll = F.nll_loss(lps, targets, reduction="none")
    sums.nll += nll.sum(dtype=torch.float64)
    sums.tokens += targets.numel()
    if teacher is not None:
        lpt = _log_probs(teacher)
        kl = (lpt.exp() * (lpt - lps.to(lpt.dtype))).sum(-1)
        sums.kl += kl.sum(dtype=torch.float64)
        sums.teacher_nll += F.nll_loss(lpt, targets, reduction="none").sum(dtype=torch.float64)
        sums.agree += int((student.argmax(-1) == teacher.argmax(-1)).sum())


def _check_logits(logits: torch.Tensor, batch: torch.Tensor, who: str) -> None:
    if logits.dim() != 3 or logits.shape[:2] != batch.shape:
        raise EvalInputError(f"{who} returned logits of shape {tuple(logits.shape)} for input "
                             f"{tuple(batch.shape)}; expected [B, T, vocab]")


@torch.no_grad()
def evaluate_windows(model: LogitsFn, windows: list[torch.Tensor], teacher: LogitsFn | None = None,
                     batch_size: int = 1, device: str | torch.device = "cpu", progress: bool = True) -> EvalResult:
    """Score windows (each [n, T]) with `model` (and `teacher`); see the module doc for the math."""
    if not windows:
        raise EvalInputError("nothing to evaluate: no window has 2 or more tokens")
    sums = _Sums()
    batches = [w[i:i + batch_size] for w in windows for i in range(0, w.shape[0], batch_size)]
    for batch in bar(batches, desc="eval", unit="batch", enabled=progress):
        batch = batch.to(device)
        s_logits = model(batch)
        _check_logits(s_logits, batch, "model")
        t_logits = None
        if teacher is not None:
            t_logits = teacher(batch)
            _check_logits(t_logits, batch, "teacher")
            if t_logits.shape[-1] != s_logits.shape[-1]:
                raise EvalInputError(f"teacher vocab {t_logits.shape[-1]} != student vocab {s_logits.shape[-1]}: "
                                     "KL needs the same vocabulary (was the student built from this teacher?)")
        for r in range(batch.shape[0]):
            _score_row(s_logits[r, :-1], batch[r, 1:], None if t_logits is None else t_logits[r, :-1], sums)
        sums.windows += batch.shape[0]
    nll = float(sums.nll / sums.tokens)
    return EvalResult(
        ppl=math.exp(nll), nll=nll, tokens=sums.tokens, windows=sums.windows,
        seq_len=max(w.shape[1] for w in windows),
        kl=None if teacher is None else float(sums.kl / sums.tokens),
        top1_agree=None if teacher is None else sums.agree / sums.tokens,
        teacher_ppl=None if teacher is None else math.exp(float(sums.teacher_nll / sums.tokens)),
    )


def evaluate_text(model: LogitsFn, text: str | os.PathLike, tokenizer: Any, seq_len: int, max_tokens: int,
                  teacher: LogitsFn | None = None, batch_size: int = 1, device: str | torch.device = "cpu",
                  progress: bool = True, bos_id: int | None = None) -> EvalResult:
    """Perplexity (and KL / top-1 agreement against `teacher`) on the first `max_tokens` of a file;
    `bos_id`: windows start with BOS (megatron_tc.data.bos.resolve_bos_id of the teacher's tokenizer)."""
    ids = tokenize_file(text, tokenizer, max_tokens)
    result = evaluate_windows(model, make_windows(ids, seq_len, bos_id), teacher=teacher, batch_size=batch_size,
                              device=device, progress=progress)
    result.bos = bos_id is not None
    return result
