"""The pipeline's select stage with the forward-scored policies: `ar` scores students built in closed
form from a statistics pass over every layer (as tools/select_layers.py --stats does); before the
fix the stage passed no statistics and the default scoring init refused to build."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _tiny_teacher_and_text(tmp_path: Path) -> list[str]:
    """A 4-layer random Llama teacher and a synthetic corpus; the distill.py overrides using them."""
    from megatron_tc.testing import write_tiny_teacher

    write_tiny_teacher(tmp_path, n_docs=24, words_per_doc=(50, 200))
    return ["configs/tiny.yaml", "run.stages=[convert,select]", f"model.teacher={tmp_path / 'teacher'}",
            f"data.source.paths=[{tmp_path / 'text'}]", "data.source.split_by=file"]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID")}
    return env | {"OMP_NUM_THREADS": "1"}


def test_ar_policy_selects_from_scored_students(tmp_path):
    args = _tiny_teacher_and_text(tmp_path)
    cmd = [sys.executable, str(ROOT / "tools" / "distill.py"), *args, f"run.run_dir={tmp_path / 'run'}",
           "model.policy=ar", "model.keep_count=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    selection = json.loads((tmp_path / "run" / "select" / "selection.json").read_text())
    assert selection["policy"] == "ar" and len(selection["keep"]) == 1 and selection["pattern"].count("A") == 1
    scores = {int(k): v for k, v in selection["scores"].items()}
    assert sorted(scores) == [0, 1, 2, 3] and selection["keep"] == [max(scores, key=scores.get)]


def test_stats_policy_over_two_ranks_selects_as_one_process(tmp_path):
    """The statistics behind policy=stats (readout_gap) are DP-sharded sums: two ranks choose what
    one process chooses. Before the fix rank 0 all-reduced alone while rank 1 waited: a hang."""
    args = _tiny_teacher_and_text(tmp_path)
    common = [*args, "model.policy=stats", "model.keep_count=2"]
    one = subprocess.run([sys.executable, str(ROOT / "tools" / "distill.py"), *common, f"run.run_dir={tmp_path / 'one'}"],
                         cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-4000:]
    two = subprocess.run(["bash", str(ROOT / "launch" / "distill.sh"), *common, f"run.run_dir={tmp_path / 'two'}"],
                         cwd=ROOT, env=_clean_env() | {"NPROC": "2", "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]
    got, want = (json.loads((tmp_path / run / "select" / "selection.json").read_text()) for run in ("two", "one"))
    assert got["policy"] == want["policy"] == "readout_gap"
    assert got["keep"] == want["keep"] and len(want["keep"]) == 2
    assert sorted(got["scores"]) == sorted(want["scores"])
    for layer, score in want["scores"].items():
        assert abs(got["scores"][layer] - score) <= 1e-9 * max(1.0, abs(score)), layer
