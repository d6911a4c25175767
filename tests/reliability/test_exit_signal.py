"""Stage 2 asked to stop by SIGTERM (Slurm's time limit, `timeout`, scancel) at a random step: it
finishes that step, writes a checkpoint there, exits with 128 + 15, and the same command resumes it
to a result equal to an uninterrupted run. Without run.exit_signals, SIGTERM ends it at once.
Real subprocesses of `tools/distill.py` on the tiny random teacher of tests/reliability/_rundir.py."""
from __future__ import annotations

import json
import os
import random
import re
import signal

from tests.reliability._rundir import STEPS, Job, assert_same_run, checkpoints, clone, records, wait_for_records

SEED = int(os.environ.get("RELIABILITY_SEED", random.randrange(1_000_000)))
STEPS_GRID = 60  # the grid test's cells: seconds of steps (tens of ms each); the grid passes a signal on within 0.1 s


def test_sigterm_checkpoints_the_current_step_and_resume_equals_uninterrupted_run(reference, template, tmp_path):
    target = random.Random(SEED).randint(2, STEPS - 3)
    base = clone(template, tmp_path)
    job = Job(base, name="signalled")
    wait_for_records(base / "run/stage2/train_log.jsonl", target, job)
    job.proc.send_signal(signal.SIGTERM)
    rc = job.wait()
    out, context = job.output(), f"(RELIABILITY_SEED={SEED}: SIGTERM after step {target})"
    assert rc == 128 + signal.SIGTERM, f"{context} rc {rc}:\n{out[-3000:]}"
    stopped_at = records(base / "run/stage2/train_log.jsonl")[-1]["step"]
    assert target <= stopped_at < STEPS, context
    assert f"stage2: SIGTERM received: checkpoint at step {stopped_at}, then stop" in out, out[-3000:]
    assert "SIGTERM received during stage2: stopped with its state saved" in out
    # a checkpoint at the step it stopped on, even between checkpoint_interval's (every 2 steps)
    assert (checkpoints(base) / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert json.loads((base / "run/manifest.json").read_text())["stages"]["stage2"]["status"] == "stopped"
    assert not (base / "run/stage2/student").exists()
    resume = Job(base, name="resume").finished_ok()
    assert re.findall(r"stage2: resumed at step (\d+)", resume.output()) == [str(stopped_at)], context
    assert_same_run(reference(), base)


def test_with_no_exit_signals_sigterm_ends_the_run_at_once(template, tmp_path):
    base = clone(template, tmp_path)
    job = Job(base, "run.exit_signals=[]", name="plain")
    seen = wait_for_records(base / "run/stage2/train_log.jsonl", 3, job)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == -signal.SIGTERM, f"log had {seen} steps:\n{job.output()[-3000:]}"
    assert "received" not in job.output()


def test_a_signal_to_one_rank_stops_both_ranks_at_the_same_step(template, tmp_path):
    """Two gloo ranks through launch/distill.sh; rank 0 alone sends itself SIGTERM after step 5
    (fault `term@step:5`). The ranks agree on it at step 6's check, so both stop there, step 6's
    checkpoint holds both ranks' shards, and the same command resumes from it to the end."""
    import subprocess
    import sys

    from tests.reliability._rundir import ROOT, child_env

    base = clone(template, tmp_path)

    def launch(faults=None):
        env = child_env(faults)
        env.update(NPROC="2", PYTHON=sys.executable)
        return subprocess.run(["bash", str(ROOT / "launch" / "distill.sh"), str(base / "run.yaml")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=400)

    first = launch("term@step:5")
    out = first.stdout + first.stderr
    assert first.returncode == 128 + signal.SIGTERM, f"rc {first.returncode}:\n{out[-4000:]}"
    assert "[rank 0] INFO megatron_tc.distill.stage2: stage2: SIGTERM received: checkpoint at step 6, then stop" in out
    # each rank's CLI reports the stop (rank 1 never received the signal itself)
    assert out.count("SIGTERM received during stage2: stopped with its state saved") == 2, out[-4000:]
    assert (checkpoints(base) / "latest").read_text().strip() == "step_00000006"
    assert [r["step"] for r in records(base / "run/stage2/train_log.jsonl")] == list(range(1, 7))
    second = launch()
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "stage2: resumed at step 6 " in out, out[-4000:]
    # DeepSpeed's notices that ask nothing of the user stay out of the log (deepspeed_engine.py)
    assert "FutureWarning" not in out and "leaf module configuration" not in out, out[-4000:]
    assert [r["step"] for r in records(base / "run/stage2/train_log.jsonl")] == list(range(1, STEPS + 1))


def test_a_grid_passes_the_signal_to_its_running_cell_and_starts_no_other(template, tmp_path):
    """SIGTERM to the grid process alone (not its process group): the grid passes it to the cell's
    `tools/distill.py`, which checkpoints its step and exits 143; the cell is left pending (no
    cell.json, so the next invocation resumes it), the next cell never starts, the grid exits 3."""
    import shutil
    import subprocess
    import sys
    import time

    from tests.reliability._rundir import ROOT, child_env

    src = clone(template, tmp_path / "src", steps=STEPS_GRID)
    grid = {"base": str(src / "run.yaml"), "out": str(tmp_path / "grid"), "mode": "pipeline",
            "overrides": ["run.stages=[stage2]", "distill.checkpoint_interval=100", "distill.eval_interval=100"],
            "axes": {"teacher": {"t": str(src / "run" / "teacher")}, "policy": ["uniform"],
                     "init": ["naive", "zero_gate"]}}
    (tmp_path / "grid.yaml").write_text(json.dumps(grid))
    cells = {init: tmp_path / "grid" / "t" / "uniform" / init for init in ("naive", "zero_gate")}
    for cell in cells.values():  # the stages before stage 2, done: the teacher and the init student
        for sub in ("teacher", "init"):
            shutil.copytree(src / "run" / sub, cell / sub)
    cmd = [sys.executable, str(ROOT / "tools" / "run_grid.py"), str(tmp_path / "grid.yaml")]
    grid_proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
    log = cells["naive"] / "stage2" / "train_log.jsonl"
    deadline = time.monotonic() + 300
    while not (log.is_file() and len(log.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        assert grid_proc.poll() is None, grid_proc.stdout.read()
        time.sleep(0.01)
    grid_proc.send_signal(signal.SIGTERM)
    out = grid_proc.communicate(timeout=300)[0]
    assert grid_proc.returncode == 3, out[-3000:]
    pipeline_log = (cells["naive"] / "pipeline.log").read_text()
    stopped_at = int(re.findall(r"stage2: SIGTERM received: checkpoint at step (\d+), then stop", pipeline_log)[0])
    assert 3 <= stopped_at < STEPS_GRID and "[2/2] t/uniform/zero_gate: pending (SIGTERM received)" in out, out[-3000:]
    assert not list((tmp_path / "grid").rglob("cell.json")) and not (cells["zero_gate"] / "stage2").exists()
    assert (cells["naive"] / "stage2" / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    # the next invocation (here only the stopped cell's init) resumes it; its pipeline.log keeps both parts
    (tmp_path / "grid_naive.yaml").write_text(json.dumps({**grid, "axes": {**grid["axes"], "init": ["naive"]}}))
    again = subprocess.run([*cmd[:-1], str(tmp_path / "grid_naive.yaml")], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    pipeline_log = (cells["naive"] / "pipeline.log").read_text()
    assert pipeline_log.count("==== ") == 2 and pipeline_log.startswith("==== "), pipeline_log[:500]
    assert f"stage2: SIGTERM received: checkpoint at step {stopped_at}, then stop" in pipeline_log
    assert f"stage2: resumed at step {stopped_at} " in pipeline_log.split("==== ")[2], pipeline_log[-3000:]
    # that a resumed run equals an uninterrupted one: test_sigterm_checkpoints_the_current_step_and_resume_equals_uninterrupted_run
