"""Statistics with DP=2 (one all-reduce) equal DP=1 on the union of the data."""
import torch

from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_stats


def test_dp2_stats_equal_single_process_on_union(tmp_path):
    path = str(tmp_path / "dp2.pt")
    run_distributed(_workers_stats.dp_stats, 2, path, timeout=240)
    dp2 = TaylorStats.load(path)
    ref = _workers_stats.stats_of_rows(range(4))
    assert sorted(dp2.sums) == sorted(ref.sums)
    assert any(k.startswith("readout.taylor_fit.") for k in ref.sums)
    assert dp2.meta["tokens"] == ref.meta["tokens"] == 96
    for key, want in ref.sums.items():
        got = dp2.sums[key]
        scale = want.abs().max().clamp_min(1e-300)
        assert float((got - want).abs().max() / scale) <= 1e-10, key
