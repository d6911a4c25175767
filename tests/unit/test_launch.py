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


def path_without(tmp_path: Path, *names: str) -> str:
    """A PATH with every program of /usr/bin and /bin except `names` (e.g. a host without Slurm)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for directory in (Path("/bin"), Path("/usr/bin")):
        for program in directory.iterdir():
            if program.name not in names and not (bin_dir / program.name).exists():
                (bin_dir / program.name).symlink_to(program)
    return str(bin_dir)


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
def test_slurm_mode_derives_rank_world_and_master_without_scontrol(nodelist, first, tmp_path):
    got = printed_env(slurm_env(nodelist), path=path_without(tmp_path, "scontrol"))
    assert got["MODE"] == "slurm"
    assert (got["RANK"], got["LOCAL_RANK"], got["WORLD_SIZE"]) == ("5", "1", "8")
    assert (got["LOCAL_WORLD_SIZE"], got["NODE_RANK"]) == ("4", "1")
    assert got["MASTER_ADDR"] == first
    assert got["MASTER_PORT"] == str(20000 + 4242 % 20000)
    assert got["OMP_NUM_THREADS"] == "1"


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


@pytest.mark.parametrize("mode_env", [{"RANK": "0", "LOCAL_RANK": "0"}, slurm_env("a"), {"NPROC": "2"}],
                         ids=["per-rank", "slurm", "workstation"])
def test_nvlink_multicast_is_left_as_the_environment_has_it(mode_env):
    assert {k: printed_env(mode_env)[k] for k in MULTICAST_OFF} == dict.fromkeys(MULTICAST_OFF, "")
    users = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NVSHMEM_DISABLE_NVLS": "0"}
    assert {k: printed_env({**mode_env, **users})[k] for k in MULTICAST_OFF} == users


@pytest.mark.parametrize("mode_env", [{"RANK": "0", "LOCAL_RANK": "0"}, slurm_env("a"), {"NPROC": "2"}],
                         ids=["per-rank", "slurm", "workstation"])
def test_the_documented_switch_turns_nvlink_multicast_off(mode_env):
    got = printed_env({**mode_env, "MEGATRON_TC_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "1"})
    assert {k: got[k] for k in MULTICAST_OFF} == MULTICAST_OFF


def test_free_port_is_a_port_nothing_listens_on():
    import socket
    import sys

    proc = run_script({"PYTHON": sys.executable}, "--free-port")
    assert proc.returncode == 0, proc.stderr
    port = int(proc.stdout)
    with socket.socket() as sock:
        sock.bind(("", port))  # raises if something holds it


def test_workstation_mode_picks_a_free_port_unless_one_is_given():
    import sys

    got = printed_env({"NPROC": "2", "PYTHON": sys.executable})
    assert 1024 <= int(got["MASTER_PORT"]) <= 65535
    assert printed_env({"NPROC": "2", "MASTER_PORT": "4321"})["MASTER_PORT"] == "4321"


# ---- launch/slurm/distill.sbatch ------------------------------------------------------------------
SBATCH = ROOT / "launch" / "slurm" / "distill.sbatch"


def sbatch_usage_lines() -> list[list[str]]:
    """The argument lists after `launch/slurm/distill.sbatch` in the script's usage comments
    (continuation lines joined)."""
    text = SBATCH.read_text().replace("\\\n#", "")
    return [line.split("launch/slurm/distill.sbatch", 1)[1].split() for line in text.splitlines()
            if line.startswith("#") and "sbatch " in line and "launch/slurm/distill.sbatch" in line]


def test_the_sbatch_usage_lines_load_through_the_config_loader():
    from megatron_tc.config import load_config, split_cli_args

    usages = sbatch_usage_lines()
    assert len(usages) == 2, usages
    for args in usages:
        path, overrides = split_cli_args(args)
        cfg = load_config(ROOT / path, overrides)
        for item in overrides:
            key, value = item.split("=", 1)
            section, name = key.split(".", 1)
            assert str(getattr(getattr(cfg, section), name)) == value, item


def test_the_sbatch_script_requests_gpus_only_through_lines_an_option_overrides():
    directives = [line.split()[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert not [d for d in directives if d.startswith("--gres")]  # --gpus-per-node=0 could not undo a gres line
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(d.startswith("--signal=USR1@") for d in directives)


@pytest.mark.parametrize("env, nproc, devices", [
    ({}, "4", "--num_gpus 4"),  # every GPU nvidia-smi lists
    ({"NPROC": "2"}, "2", "--num_gpus 2"),
    ({"CUDA_VISIBLE_DEVICES": "1,3"}, "2", "--include localhost:1,3"),  # those GPUs, not 0 and 1
    ({"CUDA_VISIBLE_DEVICES": "0,2,3", "NPROC": "2"}, "2", "--include localhost:0,2"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "2", "--num_gpus 2"),  # none visible: 2 gloo ranks on the CPU
])
def test_workstation_mode_runs_one_rank_per_visible_gpu(tmp_path, env, nproc, devices):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/bash\nfor i in 0 1 2 3; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    got = printed_env(env, path=f"{tmp_path}:/usr/bin:/bin")
    assert (got["MODE"], got["NPROC"], got["DEVICES"]) == ("workstation", nproc, devices)
    assert (got["OMP_NUM_THREADS"] != "") == (env.get("CUDA_VISIBLE_DEVICES") == "")  # set for CPU ranks only


@pytest.mark.parametrize("env, message", [
    ({"NPROC": "8"}, "8 ranks asked for (NPROC or --num_gpus) but 4 GPU(s) are visible (0,1,2,3)"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-0"}, "CUDA_VISIBLE_DEVICES=GPU-0: give GPU indices (e.g. 0,2)"),
])
def test_workstation_mode_refuses_ranks_it_cannot_place(tmp_path, env, message):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/bash\nfor i in 0 1 2 3; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc = run_script(env, "--print-env", path=f"{tmp_path}:/usr/bin:/bin")
    assert proc.returncode == 2 and proc.stdout == "" and message in proc.stderr, proc.stderr
