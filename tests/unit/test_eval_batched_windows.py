"""Evaluation during training and in the eval stage (`megatron_tc.distill.evaluation.score_rows`):
windows batched `eval.batch_size` at a time score exactly what one window per forward scores, and
every data-parallel rank runs the same number of forwards."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.distill.evaluation import TeacherCache, forward_plan, score_rows, window_rows
from megatron_tc.eval.perplexity import make_windows


class TinyLM(torch.nn.Module):
    """A causal model whose logits at t depend on tokens <= t (embedding + a causal running mean)."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, 16, generator=g, dtype=torch.float64))
        self.out = torch.nn.Parameter(torch.randn(16, vocab, generator=g, dtype=torch.float64))
        self.forwards = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        h = self.emb[ids].cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)[:, None]
        return h @ self.out


@pytest.fixture()
def rows():
    ids = torch.randint(0, 50, (13 * 8 + 5,), generator=torch.Generator().manual_seed(0))
    return window_rows(make_windows(ids, 8))  # 13 rows of 8 tokens and a tail row of 5


@pytest.mark.parametrize("batch_size", [2, 5, 13, 64])
def test_batched_forwards_score_exactly_what_single_windows_score(rows, batch_size):
    student, teacher = TinyLM(50, 1), TinyLM(50, 2)
    single = score_rows(student, teacher, rows, 0, 1)
    assert student.forwards == len(rows) == 14
    student.forwards = 0
    batched = score_rows(student, teacher, rows, 0, 1, batch_size=batch_size)
    assert student.forwards == -(-13 // batch_size) + 1  # the tail row has a length of its own
    assert batched["tokens"] == single["tokens"] == 13 * 7 + 4
    for key in ("ppl", "nll", "kl", "top1_agree", "teacher_ppl"):
        assert batched[key] == pytest.approx(single[key], rel=1e-12), key


def test_scores_equal_cross_entropy_and_kl_written_out_directly(rows):
    """nll / ppl from F.cross_entropy, KL(teacher || student) from F.kl_div, argmax agreement and the
    teacher's own ppl, window by window in fp64: what every evaluation reports."""
    import math

    import torch.nn.functional as F

    student, teacher = TinyLM(50, 1), TinyLM(50, 2)
    nll = kl = teacher_nll = agree = tokens = 0.0
    with torch.no_grad():
        for row in rows:
            s, t, targets = student(row)[0, :-1], teacher(row)[0, :-1], row[0, 1:]
            nll += float(F.cross_entropy(s, targets, reduction="sum"))
            teacher_nll += float(F.cross_entropy(t, targets, reduction="sum"))
            kl += float(F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="sum"))
            agree += float((s.argmax(-1) == t.argmax(-1)).sum())
            tokens += targets.numel()
    got = score_rows(student, teacher, rows, 0, 1, batch_size=4)
    assert got["tokens"] == tokens
    assert got["nll"] == pytest.approx(nll / tokens, rel=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-12)
    assert got["kl"] == pytest.approx(kl / tokens, rel=1e-10)
    assert got["teacher_ppl"] == pytest.approx(math.exp(teacher_nll / tokens), rel=1e-12)
    assert got["top1_agree"] == agree / tokens
    assert 0 < agree < tokens and kl > 0.1  # two different models: the KL and the agreement are informative


def test_teacher_cache_is_filled_by_a_batched_evaluation_and_reused(rows):
    student, teacher = TinyLM(50, 1), TinyLM(50, 2)
    cache = TeacherCache()
    first = score_rows(student, teacher, rows, 0, 1, cache=cache, batch_size=4)
    assert sorted(cache.rows) == list(range(14)) and teacher.forwards == 5
    again = score_rows(student, teacher, rows, 0, 1, cache=cache, batch_size=4)
    assert teacher.forwards == 5 and again == first  # the teacher did not run again


@pytest.mark.parametrize("dp_size,batch_size", [(2, 1), (2, 4), (3, 5), (4, 16)])
def test_every_rank_runs_as_many_forwards_and_every_row_is_scored_once(rows, dp_size, batch_size):
    plans = [forward_plan(rows, batch_size, r, dp_size) for r in range(dp_size)]
    assert len({len(p) for p in plans}) == 1  # ZeRO-3 gathers inside every forward
    scored = sorted(i for p in plans for ix, real in p if real for i in ix)
    assert scored == list(range(len(rows)))
    for p in plans:
        for ix, _real in p:
            assert len({rows[i].shape[-1] for i in ix}) == 1 and 1 <= len(ix) <= batch_size


def test_batch_size_below_one_is_an_error(rows):
    with pytest.raises(ValueError, match="windows per forward"):
        forward_plan(rows, 0, 0, 1)
