"""The project's own launch/slurm/distill.sbatch, submitted to a real (one-node, CPU) Slurm cluster
with command-line options in place of its GPU lines, runs the whole pipeline of configs/tiny.yaml on
2 tasks. (Resuming through sbatch: test_preemption.py.)"""
from __future__ import annotations

import json
import re

from tests.slurm._jobs import CPU_OPTIONS, submit, wait_finished


def test_sbatch_runs_the_whole_pipeline_on_a_cpu_partition(tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    args = ["configs/tiny.yaml", f"model.teacher={tiny_assets / 'teacher'}",
            f"data.source.paths=[{tiny_assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run_dir}"]
    log = tmp_path / "job.out"
    job = submit([*CPU_OPTIONS, "--time=10", f"--output={log}"], args)
    info = wait_finished(job, log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    port = re.search(rf"megatron_tc: job {job} \(restart 0\) on \S+, port (\d+)", out)
    assert port and 1024 <= int(port.group(1)) <= 65535, out[:2000]
    # both tasks are ranks of one world of 2 (rank 0 logs at INFO, rank 1 only its warnings)
    assert "[rank 0] INFO megatron_tc.distill.runner: stage stage2: running" in out
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert {s: v["status"] for s, v in manifest.items()} == dict.fromkeys(
        ("convert", "select", "stats", "init", "stage1", "stage2", "eval", "export"), "complete")
    latest = (run_dir / "stage2/checkpoints/latest").read_text().strip()
    state = json.loads((run_dir / "stage2/checkpoints" / latest / "state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["layout"]["dp"] == 2, state["layout"]
    rows = [r["model"] for r in json.loads((run_dir / "eval/results.json").read_text())["rows"]]
    assert rows[-1] == "after distillation", rows
    assert (run_dir / "export/hf/config.json").is_file() and list((run_dir / "tensorboard").glob("events.*"))

