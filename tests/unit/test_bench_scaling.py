"""tools/bench/scaling.py --quick: the driver starts real torchrun jobs of 1 and 2 gloo ranks (ZeRO-3
through DeepSpeed on the tiny preset) and derives tokens/s and the scaling efficiency from them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tc.bench.scaling import add_efficiency, rank_counts

ROOT = Path(__file__).resolve().parents[2]


def test_rank_counts_double_up_to_the_limit_and_include_it():
    assert rank_counts(1) == [1]
    assert rank_counts(2) == [1, 2]
    assert rank_counts(4) == [1, 2, 4]
    assert rank_counts(6) == [1, 2, 4, 6]


def test_efficiency_is_relative_to_one_rank_and_skips_failed_rows():
    rows = [{"N": 1, "tok_per_s": 100.0}, {"N": 2, "tok_per_s": 180.0}, {"N": 4, "note": "failed"}]
    add_efficiency(rows)
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] == pytest.approx(0.9)
    assert "efficiency" not in rows[2]


def test_quick_run_measures_one_and_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench_scaling.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "scaling.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["N"] for r in rows] == [1, 2]
    for r in rows:
        assert r["backend"] == "gloo" and r["dp"] == r["N"] and r["finite"] and r["multicast_off"]
        assert len(r["step_ms_all"]) == 3
        assert r["tok_per_s"] == pytest.approx(r["N"] * 2 * 64 / (r["step_ms"] * 1e-3))
        assert r["tok_per_s_per_gpu"] == pytest.approx(r["tok_per_s"] / r["N"])
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["tok_per_s"] / (2 * rows[0]["tok_per_s"]))
    table = out.with_suffix(".md").read_text()
    assert "| N | model |" in table and "efficiency" in table
    assert (tmp_path / "bench_scaling_logs" / "ranks2.log").stat().st_size > 0
