"""Statistics with DP=2 (one all-reduce) equal DP=1 on the union of the data; student-forced
alignment split over 2 ranks equals one process."""
import functools

import pytest
import torch

from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_stats


@pytest.mark.parametrize("rank0_only", [False, True], ids=["rows_dealt", "a_rank_without_rows"])
def test_dp2_stats_equal_single_process_on_union(tmp_path, rank0_only):
    """Also with a rank that has no calibration row (more data-parallel ranks than rows): its sums
    are zeros and it joins the all-reduce."""
    path = str(tmp_path / "dp2.pt")
    run_distributed(_workers_stats.dp_stats, 2, path, rank0_only, timeout=240)
    dp2 = TaylorStats.load(path)
    ref = _workers_stats.stats_of_rows(range(4))
    assert sorted(dp2.sums) == sorted(ref.sums)
    assert any(k.startswith("readout.taylor_fit.") for k in ref.sums)
    assert dp2.meta["tokens"] == ref.meta["tokens"] == 96
    for key, want in ref.sums.items():
        got = dp2.sums[key]
        scale = want.abs().max().clamp_min(1e-300)
        assert float((got - want).abs().max() / scale) <= 1e-10, key


def _tp2_stats_match(worker, path: str, ref: TaylorStats) -> TaylorStats:
    """Run `worker` on 2 ranks (TP=2); its saved sums equal `ref`'s (TP reorders fp32 sums)."""
    run_distributed(worker, 2, path, timeout=240)
    tp2 = TaylorStats.load(path)
    assert sorted(tp2.sums) == sorted(ref.sums)
    for key, want in ref.sums.items():
        torch.testing.assert_close(tp2.sums[key], want, rtol=1e-5, atol=1e-6, msg=key)
    return tp2


def test_tp2_stats_equal_tp1(tmp_path):
    from megatron_tc.calibrate.stats import collect_attention_stats

    model, ids, doc_ids = _workers_stats.tiny_teacher_and_rows()
    batches = _workers_stats.row_batches(ids, doc_ids, range(4))
    ref = collect_attention_stats(model, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24}, chunk_size=5, progress=False)
    _tp2_stats_match(_workers_stats.tp_stats, str(tmp_path / "tp2.pt"), ref)


def test_tp2_readout_sums_equal_tp1(tmp_path):
    """With a TP=2 teacher the readout sweep gathers one attention layer at a time: every sum (attention
    moments and taylor / taylor_fit readout sums) equals the single-process pass."""
    tp2 = _tp2_stats_match(_workers_stats.tp_full_stats, str(tmp_path / "tp2_full.pt"),
                           _workers_stats.stats_of_rows(range(4)))
    assert any(k.startswith("readout.taylor_fit.") for k in tp2.sums)


def test_tp_ranks_whose_layer_io_budgets_differ_agree_on_sweep_2(tmp_path):
    """Rank 0 could keep the layers' inputs for sweep 2 and rank 1 could not: both take the same
    way (the ranks of a TP group run sweep 2's collectives together), and the sums equal one process's."""
    _tp2_stats_match(functools.partial(_workers_stats.tp_full_stats, unequal_budgets=True),
                     str(tmp_path / "tp2_unequal.pt"), _workers_stats.stats_of_rows(range(4)))


def test_student_forced_alignment_on_2_ranks_equals_one_process(tmp_path):
    """Layers 0 and 2 are aligned on ranks 0 and 1; layer 2's inputs go through rank 0's layer 0,
    so it must be broadcast before the stream moves on: both ranks end with the one-process student."""
    path = str(tmp_path / "seqres.pt")
    run_distributed(_workers_stats.student_forced_alignment, 2, path, timeout=240)
    got = torch.load(path)
    want, report = _workers_stats.student_forced_student()
    assert got["align"] == report["align"]
    for state in got["states"]:
        for name, value in want.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
