"""The project's own launch/slurm/distill.sbatch, submitted to a real (one-node, CPU) Slurm cluster
with command-line options in place of its GPU lines, runs the whole pipeline of configs/tiny.yaml:
a first job of 2 tasks stops stage 2 at a checkpoint (--stop-after), and the same command submitted
with 1 task resumes it there (data-parallel size 2 -> 1) and finishes the pipeline. (A stop by the
time-limit signal and requeue: test_preemption.py.)"""
from __future__ import annotations

import json
import re

from tests.slurm._jobs import CPU_OPTIONS, submit, wait_finished

STAGES = ("convert", "select", "stats", "init", "stage1", "stage2", "eval", "export")


def test_sbatch_runs_the_pipeline_on_a_cpu_partition_and_resumes_on_fewer_tasks(tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    args = ["configs/tiny.yaml", f"model.teacher={tiny_assets / 'teacher'}",
            f"data.source.paths=[{tiny_assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run_dir}"]
    log = tmp_path / "first.out"
    job = submit([*CPU_OPTIONS, "--time=10", f"--output={log}"], [*args, "--stop-after", "2"])
    info = wait_finished(job, log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    port = re.search(rf"megatron_tc: job {job} \(restart 0\) on \S+, port (\d+)", out)
    assert port and 1024 <= int(port.group(1)) <= 65535, out[:2000]
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert [manifest[s]["status"] for s in STAGES[:6]] == ["complete"] * 5 + ["stopped"], manifest
    state = json.loads((run_dir / "stage2/checkpoints/step_00000002/state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["layout"]["dp"] == 2, state["layout"]

    log = tmp_path / "second.out"
    options = [o if not o.startswith("--ntasks-per-node") else "--ntasks-per-node=1" for o in CPU_OPTIONS]
    job = submit([*options, "--time=10", f"--output={log}"], args)
    info = wait_finished(job, log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert "(data-parallel size 2) with data-parallel size 1 through a DeepSpeed universal checkpoint" in out
    assert "stage2: resumed at step 2 " in out, out[-4000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert {s: v["status"] for s, v in manifest.items()} == dict.fromkeys(STAGES, "complete")
    steps = [json.loads(line)["step"] for line in (run_dir / "stage2/train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    rows = [r["model"] for r in json.loads((run_dir / "eval/results.json").read_text())["rows"]]
    assert rows[-1] == "after distillation", rows
    assert (run_dir / "export/hf/config.json").is_file() and list((run_dir / "tensorboard").glob("events.*"))
