"""The eval stage's tokens-to-target (eval.target_ppl_factors, from stage 2's evaluations) and its
long-context probe (eval.probe_lengths), on a tiny pipeline."""
from __future__ import annotations

import json
import math

import pytest

from megatron_tc.testing import run_distributed
from tests._scripts import distill_main
from tests.unit.test_pipeline_cli import ROOT, tiny_assets  # noqa: F401 (a fixture)


def test_the_eval_stage_reports_tokens_to_target_and_the_probe(tiny_assets, tmp_path):
    run = tmp_path / "run"
    argv = [str(ROOT / "configs" / "tiny.yaml"), f"model.teacher={tiny_assets / 'teacher'}",
            f"data.source.paths=[{tiny_assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run}",
            "run.stages=[convert,select,stats,init,stage2,eval]", "calibrate.init=naive", "distill.stage2.steps=4",
            "distill.eval_interval=2", "eval.target_ppl_factors=[1.0e6,1.0e-6]", "eval.probe_lengths=[256,512]"]
    run_distributed(distill_main, 1, argv, timeout=300)
    results = json.loads((run / "eval" / "results.json").read_text())
    teacher_ppl = results["rows"][0]["ppl"]
    evals = [json.loads(line) for line in (run / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    # a target above every evaluation is reached at the first one (tokens 0); one below all, never
    assert results["tokens_to_target"] == [
        {"k": 1.0e6, "target_ppl": 1.0e6 * teacher_ppl, "tokens": 0.0, "last_tokens": float(evals[-1]["tokens"])},
        {"k": 1.0e-6, "target_ppl": 1.0e-6 * teacher_ppl, "tokens": None, "last_tokens": float(evals[-1]["tokens"])}]
    assert all(math.isclose(t["target_ppl"], t["k"] * teacher_ppl) for t in results["tokens_to_target"])
    probe = json.loads((run / "long_context.json").read_text())
    assert probe["lengths"] == [256, 512] and probe["samples"] == {"256": 20, "512": 20}
    assert set(probe["accuracy"]) == {"teacher", "student"} and probe["model"] == str(run / "stage2" / "student")
    assert results["long_context"]["accuracy"] == probe["accuracy"]
    table = (run / "eval" / "results.md").read_text()
    assert f"Stage-2 tokens to 1e+06x the teacher's perplexity ({1.0e6 * teacher_ppl:.2f}): 0" in table
    assert f"Stage-2 tokens to 1e-06x the teacher's perplexity ({1.0e-6 * teacher_ppl:.2f}): not reached in " \
           f"{evals[-1]['tokens']:,.0f}" in table
    assert "Long-context probe (accuracy by context length, long_context.json):" in table

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalar = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]  # noqa: E731
    for row in results["rows"]:
        name = row["model"].replace(" ", "_")
        assert scalar(f"eval/{name}/ppl") == [(0, pytest.approx(row["ppl"], rel=1e-6))]
    assert scalar("eval/tokens_to_target/1e+06x") == [(0, 0.0)]
    assert "eval/tokens_to_target/1e-06x" not in events.Tags()["scalars"]  # not reached: no point
    for name, accuracy in probe["accuracy"].items():
        assert scalar(f"long_context/{name}/accuracy") == [(int(L), pytest.approx(a)) for L, a in accuracy.items()]
    for stage in ("convert", "select", "stats", "init", "stage2", "eval"):
        assert len(scalar(f"time/{stage}_s")) == 1
    selection = json.loads((run / "select" / "selection.json").read_text())
    assert [step for step, _ in scalar("select/kept")] == ([] if not selection["scores"] else sorted(
        int(layer) for layer in selection["scores"]))


def test_a_probe_length_too_short_for_the_tokenizer_is_one_config_error_on_every_rank(tmp_path):
    """Raised before rank 0 loads anything (every rank builds the examples), so no rank waits."""
    from types import SimpleNamespace

    import pytest

    from megatron_tc.config import ConfigError, load_config
    from megatron_tc.distill.final import run_long_context_probe
    from megatron_tc.eval.long_context import HEADER
    from megatron_tc.eval.tiny import word_tokenizer

    tokenizer = word_tokenizer(HEADER.split() + ["="] + [f"k{i}" for i in range(50)] + [str(d) for d in range(10)])
    for rank in (0, 1):
        ctx = SimpleNamespace(cfg=load_config(ROOT / "configs" / "tiny.yaml", ["eval.probe_lengths=[16,4096]"]),
                              device="cpu", rank0=rank == 0, teacher_meta=lambda: SimpleNamespace(tokenizer=tokenizer))
        with pytest.raises(ConfigError, match=r"^eval.probe_lengths=\[16, 4096\]: length 16 fits only 0 pairs"):
            run_long_context_probe(ctx, tmp_path / "no-student")
