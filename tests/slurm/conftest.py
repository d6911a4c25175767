"""The Slurm tests need a running cluster with one node of at least 2 CPUs: `.ci/run` installs
Debian's slurm-wlm and munge, writes a slurm.conf for the host and starts the daemons
(.ci/slurm.sh); elsewhere these tests skip, saying why."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _cluster_problem() -> str | None:
    if not shutil.which("sbatch") or not shutil.which("scontrol"):
        return "Slurm is not installed (.ci/run installs slurm-wlm and munge and starts a one-node cluster)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t %c"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "no Slurm controller answers within 15 s (.ci/run starts one)"
    nodes = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not nodes:
        return f"no Slurm controller answers ({proc.stderr.strip() or 'no nodes'}); .ci/run starts one"
    if not any(state.rstrip("*") in ("idle", "mix") and int(cpus) >= 2 for state, cpus in nodes):
        return f"no idle Slurm node with 2 CPUs (sinfo: {proc.stdout.strip()})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = _cluster_problem()
    if problem and os.environ.get("MEGATRON_TC_REQUIRE_SLURM") == "1":
        pytest.fail(f"MEGATRON_TC_REQUIRE_SLURM=1 but {problem}")
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory, slurm_cluster):
    """A tiny random Llama teacher (HF directory with a sentencepiece tokenizer) and a text corpus."""
    from megatron_tc.testing import write_tiny_teacher

    return write_tiny_teacher(tmp_path_factory.mktemp("tiny"), n_docs=40, words_per_doc=(50, 300))
