"""The `select` stage with `ga` and `ar` on 2 gloo ranks (data-parallel) with a whole teacher on
each: every rank runs the policy (ga's probe layers are aligned dealt over both ranks), both
finish with the same choice, and it equals one process's."""
import json
from dataclasses import replace

import pytest

from megatron_tc.calibrate import strategies
from megatron_tc.testing import run_distributed, write_tiny_teacher
from tests.parallel import _workers_select as workers


def test_ga_and_ar_select_on_two_ranks_with_a_whole_teacher_equal_one_process(tmp_path, monkeypatch):
    # std 0.1: a teacher peaked enough that the layers' scores are far apart (HF's 0.02 gives near ties)
    assets = str(write_tiny_teacher(tmp_path / "assets", initializer_range=0.1))
    run_distributed(workers.select_stage, 2, assets, str(tmp_path), timeout=240)
    monkeypatch.setattr(strategies, "PAPER_GA_ALIGN", replace(strategies.PAPER_GA_ALIGN, steps=workers.GA_ALIGN_STEPS))
    want = workers.select_in_one_process(assets, tmp_path / "run1")
    got = [json.loads((tmp_path / f"select2.{rank}.json").read_text()) for rank in range(2)]
    for policy in workers.POLICIES:
        reference = want[policy]
        assert reference["policy"] == policy and len(reference["keep"]) == 2
        scores = sorted(reference["scores"].values())
        assert scores[-2] - scores[-3] > 1e-2 * abs(scores[-2]), f"{policy}: the one-process choice is a near tie"
        for rank in range(2):
            assert got[rank][policy]["summary"]["keep"] == reference["keep"], (policy, rank)
            assert got[rank][policy]["selection"]["keep"] == reference["keep"], (policy, rank)
        # ga's statistics are summed over both ranks' rows and its probe layers aligned on either rank
        assert got[0][policy]["selection"]["scores"] == pytest.approx(reference["scores"], rel=1e-4), policy
