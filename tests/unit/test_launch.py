"""launch/distill.sh: the environment each mode gives a rank (run with --print-env, no training)."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "distill.sh"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_script(env: dict[str, str], *args: str, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    full_env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=30)


def printed_env(env: dict[str, str], path: str = "/usr/bin:/bin") -> dict[str, str]:
    proc = run_script(env, "--print-env", path=path)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


def slurm_env(nodelist: str, **extra: str) -> dict[str, str]:
    env = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_LOCALID="1",
               SLURM_NTASKS="8", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="4(x2)",
               SLURM_JOB_NODELIST=nodelist)
    env.update(extra)
    return env


@pytest.mark.parametrize("nodelist, first", [
    ("node17", "node17"),
    ("alpha,beta", "alpha"),
    ("gpu-[003-005,9]", "gpu-003"),
    ("gpu[12,14-15]-ib,cpu1", "gpu12-ib"),
    ("n[7]", "n7"),
])
def test_slurm_mode_derives_rank_world_and_master_without_scontrol(nodelist, first):
    got = printed_env(slurm_env(nodelist))
    assert got["MODE"] == "slurm"
    assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"]) == ("5", "1", "8")
    assert (got["LOCAL_WORLD_SIZE"], got["NODE_RANK"]) == ("4", "1")
    assert got["MASTER_ADDR"] == first
    assert got["MASTER_PORT"] == str(20000 + 4242 % 20000)
    assert got["OMP_NUM_THREADS"] == "1"
    assert {k: got[k] for k in MULTICAST_OFF} == MULTICAST_OFF


def test_slurm_mode_asks_scontrol_for_the_first_host(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "resolved-a\\nresolved-b\\n"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    got = printed_env(slurm_env("weird[1-2]"), path=f"{tmp_path}:/usr/bin:/bin")
    assert got["MASTER_ADDR"] == "resolved-a"


def test_slurm_mode_keeps_explicit_master_and_threads_from_cpus_per_task():
    got = printed_env(slurm_env("a,b", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234", SLURM_CPUS_PER_TASK="6",
                                SLURM_NTASKS_PER_NODE="2"))
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.1", "1234")
    assert (got["OMP_NUM_THREADS"], got["LOCAL_WORLD_SIZE"]) == ("6", "2")


def test_different_jobs_get_different_ports():
    ports = {printed_env(slurm_env("a", SLURM_JOB_ID=str(job)))["MASTER_PORT"] for job in (1, 2, 77777)}
    assert len(ports) == 3


def test_allocation_without_a_job_step_is_the_workstation_mode():
    env = slurm_env("a")
    del env["SLURM_STEP_ID"]  # the batch script itself, before srun
    assert printed_env(env)["MODE"] == "workstation"


def test_launcher_variables_select_the_per_rank_mode():
    got = printed_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", **slurm_env("a")})
    assert (got["MODE"], got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"]) == ("per-rank", "3", "1", "4")
    assert {k: got[k] for k in MULTICAST_OFF} == MULTICAST_OFF


def test_workstation_on_cpu_splits_the_cores_over_gloo_ranks():
    cores = os.cpu_count() or 1
    got = printed_env({"NPROC": "2"})
    assert (got["MODE"], got["NPROC"]) == ("workstation", "2")
    assert got["OMP_NUM_THREADS"] == str(max(1, cores // 2))


def test_per_rank_mode_runs_the_pipeline_entry_point_without_local_rank_flag(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/bash\necho "ARGS $*"\necho "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"\n')
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    proc = run_script({"RANK": "0", "LOCAL_RANK": "0", "PYTHON": str(fake_python)},
                      "--local_rank=0", "configs/x.yaml", "distill.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert f"ARGS {ROOT}/tools/distill.py configs/x.yaml distill.steps=3" in proc.stdout
    assert "NCCL_NVLS_ENABLE=0" in proc.stdout
