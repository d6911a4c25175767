"""NaN/inf in the loss or the gradients of stage 2 (real `tools/distill.py` subprocesses, fault
hooks of megatron_tc.distill.faults): nan_policy=skip skips and counts, in the console log, the
train log and TensorBoard (event files read back); nan_policy=abort stops before the update and
leaves the last checkpoint intact."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.reliability._rundir import Job, checkpoints, clone, final_student, train_log

STEPS = 6


@pytest.fixture(scope="module")
def runs(template, tmp_path_factory):
    """Both runs at once: skip (NaN loss at step index 1, NaN gradients at 3) and abort (NaN
    gradients at step index 3)."""
    skip = clone(template, tmp_path_factory.mktemp("skip"), steps=STEPS)
    abort = clone(template, tmp_path_factory.mktemp("abort"), steps=STEPS)
    jobs = {"skip": Job(skip, faults="nan_loss@1,nan_grad@3", name="skip"),
            "abort": Job(abort, "distill.nan_policy=abort", faults="nan_grad@3", name="abort")}
    for job in jobs.values():
        job.wait()
    return jobs


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_skip_policy_skips_counts_and_logs_to_tensorboard(runs):
    job = runs["skip"].finished_ok()
    base = job.base
    log = train_log(base)
    assert [r["applied"] for r in log] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert [r["skipped_steps"] for r in log] == [0, 1, 1, 2, 2, 2]
    out = job.output()
    assert re.search(r"step 1: non-finite loss, step skipped \(1 skipped so far\)", out), out[-3000:]
    assert re.search(r"step 3: non-finite gradient, step skipped \(2 skipped so far\)", out), out[-3000:]
    tb = tensorboard_scalars(base / "run")
    assert dict(tb["stage2/skipped_steps"]) == {1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2}
    assert [s for s, _ in tb["stage2/grad_norm"]] == [1, 2, 3, 4, 5, 6]
    assert [math.isnan(v) for _, v in tb["stage2/grad_norm"]] == [False, True, False, True, False, False]
    manifest = json.loads((base / "run/manifest.json").read_text())["stages"]["stage2"]
    assert manifest["status"] == "complete" and manifest["summary"]["skipped_steps"] == 2
    assert all(torch.isfinite(v).all() for v in final_student(base).values())


def test_abort_policy_stops_before_the_update_and_keeps_the_last_checkpoint(runs):
    job = runs["abort"]
    assert job.wait() not in (0, None)
    out = job.output()
    assert re.search(r"NonFiniteError: step 3: non-finite gradient; distill.nan_policy=abort stops the run", out), \
        out[-3000:]
    base = job.base
    assert [r["step"] for r in train_log(base)] == [1, 2, 3]
    assert (checkpoints(base) / "latest").read_text().strip() == "step_00000002"
    assert not (base / "run/stage2/student").exists()
    assert json.loads((base / "run/manifest.json").read_text())["stages"]["stage2"]["status"] == "failed"
    assert [s for s, _ in tensorboard_scalars(base / "run")["stage2/loss"]] == [1, 2, 3]
