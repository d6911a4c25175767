"""configs/gpu_smoke.yaml and tools/bench/prepare_smoke.py (megatron_tc.bench.smoke_inputs): what the
multi-GPU smoke run relies on."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_smoke_config_is_valid_on_one_two_and_four_gpus(world):
    from megatron_tc.config import load_config

    cfg = load_config(ROOT / "configs" / "gpu_smoke.yaml", world_size=world)
    assert cfg.run.precision == "bf16" and cfg.parallel.zero_stage == 3
    assert cfg.data.source.cache_dir == ".gpudata/corpora" and cfg.model.teacher == ".gpudata/teacher"


def test_smoke_teacher_shares_the_gdn_head_shape_of_the_scaling_preset():
    # fla compiles per (heads, head_dim): the smoke run reuses the scaling bench's compiled kernels
    from megatron_tc.bench.models import llama_1b
    from megatron_tc.bench.smoke_inputs import TEACHER

    arch = llama_1b()
    assert (TEACHER["num_attention_heads"], TEACHER["head_dim"]) == (arch.num_heads, arch.head_dim)



def test_smoke_folder_is_excluded_once_and_never_in_a_worktree(tmp_path):
    from megatron_tc.bench.smoke_inputs import exclude

    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("*.pyc\n")
    exclude(tmp_path, ".gpudata")
    exclude(tmp_path, ".gpudata")
    assert (tmp_path / ".git" / "info" / "exclude").read_text() == "*.pyc\n/.gpudata/\n"
    worktree = tmp_path / "wt"
    worktree.mkdir()
    (worktree / ".git").write_text("gitdir: elsewhere\n")  # a linked worktree: .git is a file
    exclude(worktree, ".gpudata")
    assert (worktree / ".git").read_text() == "gitdir: elsewhere\n"


def _finished_run(root: Path, world: int, stage2_loss: float | None) -> tuple[Path, Path]:
    """A run directory and launcher log as a finished 2-rank smoke run leaves them."""
    import json

    run = root / "run"
    stages = {s: {"status": "complete"} for s in ("convert", "stats", "init", "stage2", "export")}
    (run / "stage2").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"stages": stages, "run": {"world_size": world}}))
    (run / "config.yaml").write_text("run:\n  precision: bf16\n")
    records = [{"step": step, "loss": x} for step, x in ((1, 9.5), (2, stage2_loss))]
    (run / "stage2" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "export" / "hf").mkdir(parents=True)
    (run / "export" / "hf" / "config.json").write_text("{}")
    log = root / "launch.log"
    log.write_text("WORLD INFO DICT: {'localhost': [0, 1]}\n... dist_world_size=2\n")
    return run, log


def test_check_smoke_passes_a_finished_run_and_fails_a_nan_loss(tmp_path, capsys):
    from tests._scripts import load_script

    tool = load_script("tools/bench/check_smoke.py")
    run, log = _finished_run(tmp_path / "good", 2, 8.25)
    assert tool.main([str(run), "--log", str(log), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS stage2 losses finite: 2 logged steps, loss 9.5 -> 8.25" in out and "6/6 checks passed" in out
    run, log = _finished_run(tmp_path / "nan", 2, float("nan"))
    assert tool.main([str(run), "--log", str(log), "--world", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAIL stage2 losses finite: 2 logged steps, first non-finite at step 2: loss nan" in out
    assert "FAIL world size: manifest 2, expected 4" in out
    assert "FAIL deepspeed launcher: dist_world_size=4 in log: False, local slots 2" in out


def test_check_smoke_reports_a_null_loss_as_a_failed_check(tmp_path, capsys):
    # json.dumps(None) -> null: the check names the step instead of raising on formatting None
    from tests._scripts import load_script

    tool = load_script("tools/bench/check_smoke.py")
    run, log = _finished_run(tmp_path / "null", 2, None)
    assert tool.main([str(run), "--log", str(log), "--world", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL stage2 losses finite: 2 logged steps, first non-finite at step 2: loss None" in out
    assert "5/6 checks passed" in out
