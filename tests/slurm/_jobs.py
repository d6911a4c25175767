"""Submitting the project's launch/slurm/distill.sbatch to the Slurm cluster `.ci/run` starts, and
waiting for its jobs (tests/slurm/conftest.py skips every test when no cluster answers)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "distill.sbatch"
# The options that fit the script's 2 x 8 GPU job onto one node of a CPU partition.
CPU_OPTIONS = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
# A job still under way: SIGNALING is a running job while slurmctld's signal to it (the time limit's
# USR1 warning among them) is being delivered.
LIVE = ("PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "COMPLETING")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def job_env(**extra: str) -> dict[str, str]:
    """The submission environment (sbatch exports it to the job): this interpreter runs the ranks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_TC_FAULTS"):
        env.pop(name, None)
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore", **extra)
    return env


def submit(options: list[str], args: list[str], env: dict[str, str] | None = None) -> int:
    """`sbatch OPTIONS launch/slurm/distill.sbatch ARGS` from the repository root; the job id."""
    cmd = ["sbatch", "--parsable", *options, str(SBATCH.relative_to(ROOT)), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or job_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return int(proc.stdout.strip().split(";")[0])


def job_info(job: int) -> dict[str, str]:
    """`scontrol show job` as {field: value} (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True,
                         timeout=30).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def scontrol(*args: str) -> None:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"scontrol {' '.join(args)}: {proc.stderr}"


def wait_until(job: int, done, log: Path, timeout: float = 300, every: float = 0.5) -> dict[str, str]:
    """Poll the job until done(info) holds; its output file in the failure message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if done(info):
            return info
        time.sleep(every)
    subprocess.run(["scancel", str(job)], timeout=30)
    tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no output file)"
    raise AssertionError(f"job {job} not done within {timeout} s: {job_info(job)}\n{tail}")


def wait_finished(job: int, log: Path, timeout: float = 300) -> dict[str, str]:
    return wait_until(job, lambda info: info.get("JobState") in FINISHED, log, timeout)
