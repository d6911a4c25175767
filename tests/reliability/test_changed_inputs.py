"""A training stage whose input changed (a new init student: `calibrate.*` here, or other data or
another teacher upstream) starts over instead of resuming checkpoints trained from the old one; a
change of its own keys (more steps) resumes them, as Megatron-LM does."""
from __future__ import annotations

import json
import re

import yaml

from tests.reliability._rundir import STEPS, checkpoints, clone, train_log
from tests.reliability.test_resume_dp import ranks

STOP = 6


def _edit(base, section: str, **values) -> None:
    config = yaml.safe_load((base / "run.yaml").read_text())
    config.setdefault(section, {}).update(values)
    (base / "run.yaml").write_text(yaml.safe_dump(config))


def test_a_new_init_starts_stage2_over(template, tmp_path):
    base = clone(template, tmp_path)
    run = ranks(1)
    run(base, "--stop-after", str(STOP))
    first = json.loads((base / "run" / "manifest.json").read_text())["stages"]["stage2"]
    assert first["status"] == "stopped" and first["input"]
    _edit(base, "calibrate", init="zero_gate")  # the init stage's fingerprint: what stage 2 starts from
    out = run(base)
    assert "stage stage2: what it trains from changed since its checkpoints were written" in out, out[-3000:]
    assert not re.search(r"stage2: resumed at step", out), out[-3000:]
    assert [r["step"] for r in train_log(base)] == list(range(1, STEPS + 1))
    entry = json.loads((base / "run" / "manifest.json").read_text())["stages"]["stage2"]
    assert entry["status"] == "complete" and entry["input"] != first["input"]
    steps_seen = sorted(int(p.name.split("_")[1]) for p in checkpoints(base).glob("step_*"))
    assert steps_seen == [STEPS - 2, STEPS]


def test_more_steps_resume_the_finished_stage(template, tmp_path):
    base = clone(template, tmp_path)
    run = ranks(1)
    run(base)
    _edit(base, "distill", stage2={"steps": STEPS + 2, "lr": 3.0e-3, "warmup_steps": 1})
    out = run(base)
    assert re.search(rf"stage2: resumed at step {STEPS} ", out), out[-3000:]
    assert "what it trains from changed" not in out
    assert [r["step"] for r in train_log(base)] == list(range(1, STEPS + 3))
