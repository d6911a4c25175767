"""The pipeline's select stage with the forward-scored policies: `ar` scores students built in closed
form from a statistics pass over every layer (as tools/select_layers.py --stats does)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_tc.testing import run_distributed
from tests._scripts import distill_main

ROOT = Path(__file__).resolve().parents[2]


def _tiny_teacher_and_text(tmp_path: Path) -> list[str]:
    """A 4-layer random Llama teacher and a synthetic corpus; the distill.py overrides using them."""
    from megatron_tc.testing import write_tiny_teacher

    write_tiny_teacher(tmp_path, n_docs=24, words_per_doc=(50, 200))
    return [str(ROOT / "configs" / "tiny.yaml"), "run.stages=[convert,select]",
            f"model.teacher={tmp_path / 'teacher'}", f"data.source.paths=[{tmp_path / 'text'}]",
            "data.source.split_by=file"]


def test_ar_policy_selects_from_scored_students(tmp_path):
    args = _tiny_teacher_and_text(tmp_path)
    run_distributed(distill_main, 1, [*args, f"run.run_dir={tmp_path / 'run'}", "model.policy=ar",
                                      "model.keep_count=1"], timeout=300)
    selection = json.loads((tmp_path / "run" / "select" / "selection.json").read_text())
    assert selection["policy"] == "ar" and len(selection["keep"]) == 1 and selection["pattern"].count("A") == 1
    scores = {int(k): v for k, v in selection["scores"].items()}
    assert sorted(scores) == [0, 1, 2, 3] and selection["keep"] == [max(scores, key=scores.get)]
    # the scores and the choice in TensorBoard, over the layer index
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("select/score")] == \
        [(layer, pytest.approx(scores[layer], rel=1e-6)) for layer in range(4)]
    assert [e.value for e in events.Scalars("select/kept")] == [float(layer in selection["keep"]) for layer in range(4)]


def test_stats_policy_over_two_ranks_selects_as_one_process(tmp_path):
    """The statistics behind policy=stats (readout_gap) are DP-sharded sums: two ranks choose what
    one process chooses (every rank takes part in the all-reduce: one alone would wait for good)."""
    args = _tiny_teacher_and_text(tmp_path)
    common = [*args, "model.policy=stats", "model.keep_count=2"]
    for name, ranks in (("one", 1), ("two", 2)):  # the pipeline's CLI main on gloo ranks of the test harness
        run_distributed(distill_main, ranks, [*common, f"run.run_dir={tmp_path / name}"], timeout=300)
    got, want = (json.loads((tmp_path / run / "select" / "selection.json").read_text()) for run in ("two", "one"))
    assert got["policy"] == want["policy"] == "readout_gap"
    assert got["keep"] == want["keep"] and len(want["keep"]) == 2
    assert sorted(got["scores"]) == sorted(want["scores"])
    for layer, score in want["scores"].items():
        assert abs(got["scores"][layer] - score) <= 1e-9 * max(1.0, abs(score)), layer
