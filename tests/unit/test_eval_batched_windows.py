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
