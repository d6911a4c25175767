"""Preemption end to end on a real Slurm cluster: a job of the project's launch/slurm/distill.sbatch
(2 tasks, stage 2 of the tiny random run of tests/reliability/_rundir.py) reaches its time limit
(shortened with `scontrol update` once stage 2 runs, as an operator would), Slurm sends the
`--signal=USR1@...` warning, both ranks write a checkpoint at the step they are on and exit with
138, the script requeues the job, and the requeued job resumes there and finishes; its train log,
evaluations and final weights equal an uninterrupted run's bit for bit."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import time

from tests.reliability._rundir import ROOT, assert_same_run, build_template, child_env, clone, records
from tests.slurm._jobs import CPU_OPTIONS, LIVE, job_env, job_info, scontrol, submit, wait_finished

STEPS = 100
PACE = 0.4  # seconds each step of the job's first run sleeps: Slurm's limit checks run every ~30 s


def run_seconds(info: dict[str, str]) -> int:
    """scontrol's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, clock = info["RunTime"].rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def test_time_limit_signal_checkpoints_requeues_and_resumes_to_the_uninterrupted_result(slurm_cluster, tmp_path):
    template = build_template(tmp_path / "template")
    fast = ["distill.checkpoint_interval=1000", "distill.eval_interval=25"]
    ref = clone(template, tmp_path / "reference", steps=STEPS)
    env = child_env()
    env.update(NPROC="2", PYTHON=sys.executable)
    reference = subprocess.Popen(["bash", str(ROOT / "launch/distill.sh"), str(ref / "run.yaml"), *fast], cwd=ROOT,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    base = clone(template, tmp_path / "preempted", steps=STEPS)
    log = tmp_path / "job.out"
    job = submit([*CPU_OPTIONS, "--time=10", f"--output={log}"], [str(base / "run.yaml"), *fast],
                 job_env(MEGATRON_TC_FAULTS=f"pace@step:{PACE}"))
    train_log = base / "run/stage2/train_log.jsonl"
    deadline = time.monotonic() + 120
    while not (train_log.is_file() and len(train_log.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and job_info(job)["JobState"] in LIVE, log.read_text()
        time.sleep(0.2)
    # a limit 40-100 s ahead: the script's warning (USR1, 180 s before it) is due at once, and Slurm's
    # next limit check (every ~30 s) sends it before the limit itself is reached
    scontrol("update", f"JobId={job}", f"TimeLimit={math.ceil((run_seconds(job_info(job)) + 40) / 60)}")
    stop = re.compile(r"stage2: SIGUSR1 received: checkpoint at step (\d+), then stop")
    while not stop.search(log.read_text()):
        assert time.monotonic() < deadline + 60 and job_info(job)["JobState"] in LIVE, \
            log.read_text()[-4000:]
        time.sleep(0.2)
    stopped_at = int(stop.search(log.read_text()).group(1))
    scontrol("update", f"JobId={job}", "TimeLimit=10")  # the requeued run gets the whole time again

    info = wait_finished(job, log, timeout=300)
    out = log.read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), out[-4000:]
    first, second = out.split(f"megatron_tc: job {job} (restart 1)")
    assert "SIGUSR1 received during stage2: stopped with its state saved" in first
    assert f"requeueing job {job}" in first and 0 < stopped_at < STEPS, first[-3000:]
    assert f"stage2: resumed at step {stopped_at} " in second, second[-3000:]
    assert [r["step"] for r in records(base / "run/stage2/train_log.jsonl")] == list(range(1, STEPS + 1))

    ref_out = reference.communicate(timeout=300)[0]
    assert reference.returncode == 0, ref_out[-3000:]
    assert_same_run(ref, base)
