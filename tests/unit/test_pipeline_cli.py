"""`bash launch/distill.sh` in CPU mode (2 gloo ranks through the deepspeed launcher) runs the whole
pipeline on configs/tiny.yaml: a tiny random Llama teacher saved as an HF directory, a tiny
sentencepiece tokenizer and synthetic text, all written by the test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory) -> Path:
    from megatron_tc.testing import write_tiny_teacher

    return write_tiny_teacher(tmp_path_factory.mktemp("tiny"), n_docs=40, words_per_doc=(50, 300))


def launch(assets: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID")}
    # This interpreter runs every rank; without an activated venv (as in CI) the launcher finds
    # DeepSpeed's launcher through it too.
    env.update(NPROC="2", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "launch" / "distill.sh"), "configs/tiny.yaml", f"model.teacher={assets / 'teacher'}",
           f"data.source.paths=[{assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run_dir}",
           "logging.log_interval=2", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_cpu_launcher_runs_the_whole_pipeline_then_resumes_and_skips(tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    first = launch(tiny_assets, run_dir, "--stop-after", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert {s: manifest[s]["status"] for s in ("convert", "select", "stats", "init", "stage1")} == dict.fromkeys(
        ("convert", "select", "stats", "init", "stage1"), "complete")
    assert manifest["stage2"]["status"] == "stopped"
    assert (run_dir / "stage2/checkpoints/latest").read_text().strip() == "step_00000002"
    # alignment trains on calibrate.align_tokens (tiny.yaml: 128 of its 256 calibration tokens)
    assert json.loads((run_dir / "init/report.json").read_text())["align_tokens"] == 128

    second = launch(tiny_assets, run_dir)
    out = second.stdout + second.stderr
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    for stage in ("convert", "select", "stats", "init", "stage1"):
        assert f"stage {stage}: complete for this config, skipped" in out
    assert "resumed at step 2" in out
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert all(manifest[s]["status"] == "complete" for s in manifest), manifest
    steps = [json.loads(l)["step"] for l in (run_dir / "stage2/train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    evals = [json.loads(l) for l in (run_dir / "eval_log.jsonl").read_text().splitlines()]
    assert [e["tokens"] for e in evals] == [0, 2 * 32 * 2, 4 * 32 * 2]

    # the closing table, with every row the quickstart promises
    results = json.loads((run_dir / "eval/results.json").read_text())
    names = [r["model"] for r in results["rows"]]
    assert results["bos"] is False  # the sentencepiece tokenizer adds no BOS: plain windows
    assert json.loads((run_dir / "manifest.json").read_text())["data"]["bos"] is False
    assert names == ["teacher", "naive zero-shot", "taylor_calibrate zero-shot", "after stage 1", "after distillation"]
    assert "| after distillation |" in second.stdout and str(run_dir / "tensorboard") in second.stdout
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # every converted layer's alignment curve, whichever rank aligned it (2 ranks: layers alternate)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    pattern = json.loads((run_dir / "select/selection.json").read_text())["pattern"]
    converted = [i for i, kind in enumerate(pattern) if kind == "G"]
    assert len(converted) >= 2, pattern
    for layer in converted:
        assert len(acc.Scalars(f"align/L{layer:02d}/train")) >= 2, (layer, acc.Tags()["scalars"])
        assert [e.step for e in acc.Scalars(f"stage1/mse/L{layer:02d}")] == [2]  # logging.log_interval=2
    assert [e.step for e in acc.Scalars("align/best_relative_mse")] == converted
    assert [e.step for e in acc.Scalars("stage2/kl")] == [2, 4]

    # the exported student loads with transformers and generates
    import megatron_tc  # noqa: F401  (registers the hybrid model class)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "export/hf"))
    generated = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 7)
    assert (run_dir / "export/megatron_tc/manifest.json").is_file()


@pytest.mark.parametrize("init, known", [("taylor_fit-closed", True), ("taylor_fitt", False)])
def test_distill_cli_knows_every_registered_init(init, known):
    """tools/distill.py checks the config before it imports the pipeline: the ablations of taylor_fit,
    registered by megatron_tc.calibrate.strategies, must pass that check in a fresh process (an
    empty stage list, reported by the same check, makes every run stop there)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "distill.py"), "configs/tiny.yaml",
                           f"calibrate.init={init}", "run.stages=[]"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and "run.stages is empty" in done.stderr, done.stderr[-2000:]
    assert ("not a known strategy" in done.stderr) != known, done.stderr[-2000:]
