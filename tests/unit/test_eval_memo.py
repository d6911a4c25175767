"""The eval stage reuses stage 2's evaluations of the same checkpoints (distill.eval_memo): the
table equals the one a fresh process computes from the checkpoints alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_tc.distill.eval_memo import EvalMemo, computes_like_eval_stage
from megatron_tc.testing import run_distributed
from tests._scripts import distill_main, rank_logs
from tests.unit.test_pipeline_cli import ROOT, tiny_assets  # noqa: F401 (a fixture)


def test_rows_key_tells_apart_tokens_batch_size_and_rank_share():
    rows = [torch.arange(8)[None], torch.arange(8, 16)[None]]
    key = EvalMemo.rows_key(rows, 1, 0, 2)
    assert key == EvalMemo.rows_key([r.clone() for r in rows], 1, 0, 2)
    other = [rows[0], rows[1].clone()]
    other[1][0, 3] += 1
    assert len({key, EvalMemo.rows_key(other, 1, 0, 2), EvalMemo.rows_key(rows, 2, 0, 2),
                EvalMemo.rows_key(rows, 1, 1, 2), EvalMemo.rows_key(rows[:1], 1, 0, 2)}) == 5


def test_recall_needs_the_same_rows_and_an_unchanged_checkpoint(tmp_path):
    memo, ckpt = EvalMemo(), tmp_path / "student"
    ckpt.mkdir()
    memo.remember("k", ckpt, {"ppl": 2.0})  # no manifest: not a checkpoint, nothing kept
    assert memo.recall("k", ckpt) is None
    (ckpt / "manifest.json").write_text('{"sha256": "a"}')
    memo.remember("k", ckpt, {"ppl": 3.0})
    assert memo.recall("k", ckpt) == {"ppl": 3.0}
    assert memo.recall("other rows", ckpt) is None
    (ckpt / "manifest.json").write_text('{"sha256": "b"}')  # rewritten by a later run
    assert memo.recall("k", ckpt) is None
    assert memo.teacher_cache("k") is memo.teacher_cache("k") and memo.teacher_cache("k") is not memo.teacher_cache("j")


def test_only_fp32_eager_whole_models_compute_like_the_eval_stage():
    model = torch.nn.Linear(4, 4)
    assert computes_like_eval_stage(model)
    assert not computes_like_eval_stage(model, tp_size=2)
    assert not computes_like_eval_stage(model, compiled=True)
    assert not computes_like_eval_stage(torch.nn.Linear(4, 4).to(torch.bfloat16))

    class Engine(torch.nn.Module):  # DeepSpeed's engines wrap the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert computes_like_eval_stage(Engine(model)) and not computes_like_eval_stage(Engine(model.double()))


def _run(assets: Path, run_dir: Path, *extra: str) -> str:
    """The pipeline on 2 gloo ranks, each a fresh process (the launcher itself: test_pipeline_cli);
    returns both ranks' output."""
    log = str(run_dir.parent / f"{run_dir.name}-{len(extra)}")
    argv = [str(ROOT / "configs" / "tiny.yaml"), f"model.teacher={assets / 'teacher'}",
            f"data.source.paths=[{assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run_dir}",
            "logging.log_interval=2", "run.stages=[convert,select,stats,init,stage2,eval]", *extra]
    run_distributed(distill_main, 2, argv, log, timeout=400)
    return rank_logs(log, 2)


@pytest.mark.slow
def test_eval_stage_reuses_stage2_scores_and_matches_a_fresh_evaluation(tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    first = _run(tiny_assets, run_dir)  # ZeRO-3 over 2 ranks (tiny.yaml), eval batch 2
    reused = [line for line in first.splitlines() if "the scores stage 2 computed" in line]
    assert len(reused) == 2 and "taylor_calibrate zero-shot" in reused[0] and "after distillation" in reused[1]
    table = json.loads((run_dir / "eval/results.json").read_text())
    evals = [json.loads(line) for line in (run_dir / "eval_log.jsonl").read_text().splitlines()]
    assert table["rows"][2]["ppl"] == evals[0]["ppl"] and table["rows"][3]["ppl"] == evals[-1]["ppl"]

    second = _run(tiny_assets, run_dir, "--force", "eval")  # new processes: every model scored from its checkpoint
    assert "the scores stage 2 computed" not in second and "stage eval: done in" in second, second[-3000:]
    fresh = json.loads((run_dir / "eval/results.json").read_text())
    assert [r["model"] for r in fresh["rows"]] == ["teacher", "naive zero-shot", "taylor_calibrate zero-shot",
                                                    "after distillation"]
    for got, want in zip(table["rows"], fresh["rows"]):
        for field in ("ppl", "kl", "top1_agree"):
            assert got[field] == pytest.approx(want[field], rel=1e-9, abs=1e-12), (got["model"], field)
