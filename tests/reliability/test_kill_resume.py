"""Stage 2 killed with SIGKILL (at a random step, and in the middle of writing a checkpoint), then
resumed by the same command: the result equals an uninterrupted run. Real subprocesses of
`tools/distill.py` on a tiny random teacher, CPU, one process, deterministic settings."""
from __future__ import annotations

import json
import os
import random
import re
import signal

from tests.reliability._rundir import STEPS, Job, assert_same_run, checkpoints, clone, wait_for_records

SEED = int(os.environ.get("RELIABILITY_SEED", random.randrange(1_000_000)))


def latest_name(base) -> str:
    return (checkpoints(base) / "latest").read_text().strip()


def resumed_step(job: Job) -> int:
    found = re.findall(r"stage2: resumed at step (\d+)", job.output())
    assert len(found) == 1, f"{job.name} did not resume exactly once:\n{job.output()[-3000:]}"
    return int(found[0])


def test_sigkill_at_a_random_step_then_resume_equals_uninterrupted_run(reference, template, tmp_path):
    """SIGKILL from outside once the train log shows step S (S random, after the first checkpoint);
    the same command again resumes from `latest` and ends bit-identical to the reference run."""
    target = random.Random(SEED).randint(3, STEPS // 2)
    base = clone(template, tmp_path)
    victim = Job(base, name="victim")
    seen = wait_for_records(base / "run/stage2/train_log.jsonl", target, victim)
    victim.sigkill()
    rc = victim.wait()
    context = f"(RELIABILITY_SEED={SEED}: kill after step {target}, log had {seen} steps)"
    assert rc == -signal.SIGKILL, f"the run ended before the kill landed {context}: rc {rc}"
    assert not (base / "run/stage2/student").exists(), "a killed run must not leave a final student"
    pointer = latest_name(base)
    assert re.fullmatch(r"step_\d{8}", pointer) and int(pointer[5:]) >= 2, context
    resume = Job(base, name="resume").finished_ok()
    assert resumed_step(resume) == int(pointer[5:]), context
    assert not [p.name for p in checkpoints(base).iterdir() if p.name.startswith(".")]
    assert_same_run(reference(), base)


def test_kill_while_writing_a_checkpoint_keeps_the_previous_one_and_resumes_from_it(reference, template, tmp_path):
    """The `kill@checkpoint:6` hook SIGKILLs the writer after the step-6 files are written, before
    the rename: `latest` still names step 4, which is intact and is what the next run resumes
    from; the half-written directory is removed; the result equals the reference run."""
    base = clone(template, tmp_path)
    victim = Job(base, faults="kill@checkpoint:6", name="victim")
    assert victim.wait() == -signal.SIGKILL, victim.output()[-3000:]
    ckpt = checkpoints(base)
    assert latest_name(base) == "step_00000004"
    assert json.loads((ckpt / "step_00000004/state.json").read_text())["step"] == 4
    assert (ckpt / ".tmp-step_00000006/state.json").is_file()  # killed after its last file, before rename
    assert not (ckpt / "step_00000006").exists()
    resume = Job(base, name="resume").finished_ok()
    assert resumed_step(resume) == 4
    assert not (ckpt / ".tmp-step_00000006").exists(), "the half-written checkpoint was not cleaned up"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step_{STEPS - 2:08d}", f"step_{STEPS:08d}"]
    assert_same_run(reference(), base)
