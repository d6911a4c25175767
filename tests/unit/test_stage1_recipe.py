"""The paper's recipe as a pipeline option: stage 1 sized as a fraction of the stage-2 tokens, with
the authors' per-token RMSE loss; refused when the fraction has no stage-2 budget to refer to."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_tc.config import ConfigError, apply_overrides, config_from_dict, load_config, validate_config
from megatron_tc.distill.stage1 import relative_mse, stage1_steps, token_rmse

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    return config_from_dict(apply_overrides({"model": {"teacher": "t"}}, overrides))


def test_stage1_steps_from_tokens_or_a_fraction_of_stage2():
    base = ("data.global_batch_size=4", "data.seq_len=64")  # 256 tokens per step
    assert stage1_steps(_cfg(*base, "distill.stage1.steps=7")) == 7
    assert stage1_steps(_cfg(*base, "distill.stage1.tokens=1000")) == 4  # ceil(1000 / 256)
    cfg = _cfg(*base, "distill.stage2.tokens=6144", "distill.stage1.stage2_fraction=0.1666667")
    assert stage1_steps(cfg) == 4  # 1024 tokens: a sixth of 6144
    validate_config(cfg, world_size=1)


def test_stage1_fraction_needs_a_stage2_budget_and_excludes_tokens():
    with pytest.raises(ConfigError, match="stage2_fraction=0.5 needs distill.stage2.tokens"):
        validate_config(_cfg("distill.stage1.stage2_fraction=0.5"), world_size=1)
    with pytest.raises(ConfigError, match="both set; keep one"):
        validate_config(_cfg("distill.stage2.tokens=100", "distill.stage1.stage2_fraction=0.5",
                             "distill.stage1.tokens=10"), world_size=1)
    with pytest.raises(ConfigError, match="stage2_fraction=0.0 must be > 0"):
        validate_config(_cfg("distill.stage2.tokens=100", "distill.stage1.stage2_fraction=0"), world_size=1)


def test_rmse_is_the_mean_token_error_norm_over_sqrt_hidden():
    out = torch.tensor([[[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]])
    target = torch.tensor([[[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])
    # out - target: [2, 3, 0, 0] and [0, 0, -1, 2], norms sqrt(13) and sqrt(5); |target|^2 = 2 and 1
    assert float(token_rmse(out, target)) == pytest.approx((math.sqrt(13) + math.sqrt(5)) / 2 / math.sqrt(4))
    assert float(relative_mse(out, target)) == pytest.approx(((13 + 5) / 8) / ((2 + 1) / 8))  # 6


def test_recipe_config_loads():
    cfg = load_config(ROOT / "configs/paper/recipe_stage1.yaml", ["model.teacher=t", "distill.stage2.tokens=6291456"])
    assert cfg.distill.stage1.loss == "rmse" and cfg.run.stages.index("stage1") < cfg.run.stages.index("stage2")
    assert stage1_steps(cfg) * cfg.data.global_batch_size * cfg.data.seq_len == 6291456 // 6


def test_tiny_run_with_the_recipe(tmp_path):
    """init (taylor_calibrate) -> stage 1 (here half of the stage-2 tokens, rmse) -> stage 2, one
    process (tools/distill.py's main on one gloo rank of the test harness), on a tiny random teacher."""
    import json

    from megatron_tc.testing import run_distributed
    from tests._scripts import distill_main
    from tests.unit.test_select_stage import _tiny_teacher_and_text

    teacher_and_text = _tiny_teacher_and_text(tmp_path)[2:]  # after configs/tiny.yaml and its run.stages
    run = tmp_path / "run"
    argv = [str(ROOT / "configs" / "tiny.yaml"), *teacher_and_text, f"run.run_dir={run}",
            "run.stages=[convert,select,stats,init,stage1,stage2]", "calibrate.init=taylor_calibrate",
            "calibrate.align_steps=2", "distill.stage2.tokens=256", "distill.stage1.stage2_fraction=0.5",
            "distill.stage1.loss=rmse", "distill.eval_interval=0"]
    run_distributed(distill_main, 1, argv, timeout=300)
    stage1 = [json.loads(line) for line in (run / "stage1/train_log.jsonl").read_text().splitlines()]
    stage2 = [json.loads(line) for line in (run / "stage2/train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in stage1] == [1, 2] and [r["step"] for r in stage2] == [1, 2, 3, 4]  # 64 tokens a step
    assert all(math.isfinite(r["loss"]) for r in stage1)


def test_stage1_refuses_pipeline_parallelism_before_building_anything(tmp_path):
    """Config checks refuse stage 1 with pp > 1; a caller that skips them gets the same answer."""
    from types import SimpleNamespace

    from megatron_tc.distill.stage1 import build_stage1

    with pytest.raises(ValueError, match=r"stage1 runs with parallel.pp=1 \(got pp=2\)"):
        build_stage1(_cfg(), SimpleNamespace(pp_size=2, tp_size=1), None, None, None, [1], tmp_path / "s1", None,
                     torch.device("cpu"))
    assert not (tmp_path / "s1").exists()
