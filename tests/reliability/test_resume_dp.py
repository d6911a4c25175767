"""A stage-2 run stopped at a checkpoint written by 2 data-parallel ranks resumes on 1 rank, and one
written by 1 rank resumes on 2 (a requeued job on an allocation of another size). The checkpoint goes
through DeepSpeed's universal checkpoint (ds_to_universal, load_universal); the data position is
global, so the resumed run takes the same batches, and its losses, evaluations and final weights
follow the uninterrupted single-rank run up to the summation order of the data-parallel reduction."""
from __future__ import annotations

import re

import pytest
import torch
import yaml

from megatron_tc.testing import run_distributed
from tests._scripts import distill_main, rank_logs
from tests.reliability._rundir import STEPS, checkpoints, clone, final_student, records, train_log

STOP = 6


def ranks(world_size: int):
    """tools/distill.py's CLI on `world_size` gloo ranks, each a fresh process forked from the test
    harness's server (a requeued job on an allocation of that size, without the launcher's and the
    interpreters' start-up: the launcher has its own tests); returns the ranks' output."""
    def run(base, *args: str) -> str:
        log = str(base / f"dp{world_size}-{len(args)}")
        run_distributed(distill_main, world_size, [str(base / "run.yaml"), *args], log, timeout=400)
        return rank_logs(log, world_size)
    return run


@pytest.mark.parametrize("first, second, zero", [("dp2", "dp1", 3), ("dp1", "dp2", 3), ("dp2", "dp1", 2),
                                                 ("dp1", "dp2", 0)])
def test_a_checkpoint_resumes_on_another_data_parallel_size(reference, template, tmp_path, first, second, zero):
    """ZeRO-1/2/3 partitions go through the universal checkpoint; ZeRO-0 states are whole and load as
    they are. The reference run uses ZeRO-3 (the stage changes no arithmetic)."""
    base = clone(template, tmp_path, parallel={"zero_stage": zero})
    run = {"dp1": ranks(1), "dp2": ranks(2)}
    run[first](base, "--stop-after", str(STOP))
    written = (checkpoints(base) / f"step_{STOP:08d}" / "state.json").read_text()
    assert f'"dp": {first[-1]}' in written, written
    out = run[second](base)
    universal = (f"(data-parallel size {first[-1]}) with data-parallel size {second[-1]} through a DeepSpeed "
                 "universal checkpoint")
    assert (universal in out) == (zero > 0), out[-4000:]
    assert re.search(rf"stage2: resumed at step {STOP} ", out), out[-4000:]

    expected, got = train_log(reference()), train_log(base)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got):
        assert (a["tokens"], a["lr"]) == (b["tokens"], b["lr"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    evals = [(r["step"], r["ppl"]) for r in records(base / "run/eval_log.jsonl")]
    want = [(r["step"], r["ppl"]) for r in records(reference() / "run/eval_log.jsonl")]
    assert [s for s, _ in evals] == [s for s, _ in want]
    assert [p for _, p in evals] == pytest.approx([p for _, p in want], rel=1e-4)
    sa, sb = final_student(reference()), final_student(base)
    for name in sa:
        torch.testing.assert_close(sb[name], sa[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("now", [{"world_size": 2, "tp": 2, "pp": 1, "dp": 1},
                                 {"world_size": 2, "tp": 1, "pp": 2, "dp": 1}])
def test_a_tensor_or_pipeline_parallel_change_is_refused_with_a_clear_error(now, tmp_path):
    from megatron_tc.distill.checkpointing import CheckpointError, check_dp_reshard

    saved = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2}
    with pytest.raises(CheckpointError, match="resumes on another data-parallel size only"):
        check_dp_reshard(tmp_path, saved, now)
    check_dp_reshard(tmp_path, saved, {"world_size": 4, "tp": 1, "pp": 1, "dp": 4})  # DP alone: allowed


def _with_zero_stage(base, stage: int) -> None:
    config = yaml.safe_load((base / "run.yaml").read_text())
    config["parallel"]["zero_stage"] = stage
    (base / "run.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("first, second, written", [(1, 3, "1 or 2"), (3, 1, "3"), (0, 2, "0"), (2, 0, "1 or 2")])
def test_a_checkpoint_of_another_zero_stage_is_refused_before_anything_loads(template, tmp_path, first, second,
                                                                              written):
    """DeepSpeed loads ZeRO-0, ZeRO-1/2 and ZeRO-3 checkpoints only into an engine of the same kind
    (not through a universal checkpoint either): the resume stops with one line that names the fix,
    and the checkpoint is left as it was."""
    base = clone(template, tmp_path, parallel={"zero_stage": first})
    ranks(1)(base, "--stop-after", str(STOP))
    step = checkpoints(base) / f"step_{STOP:08d}"
    before = sorted((p.relative_to(step), p.stat().st_size) for p in step.rglob("*") if p.is_file())
    _with_zero_stage(base, second)
    with pytest.raises(AssertionError) as failed:
        ranks(1)(base)
    lines = [line for line in str(failed.value).splitlines() if line.startswith("error on rank 0: ")]
    assert lines == [f"error on rank 0: {step} was written by a ZeRO-{written} engine but this job's engine runs "
                     f"ZeRO-{second}, and DeepSpeed cannot load one into the other: resume with "
                     f"parallel.zero_stage={written.split()[0]}, or start a new run directory"], \
        str(failed.value)[-3000:]
    assert sorted((p.relative_to(step), p.stat().st_size) for p in step.rglob("*") if p.is_file()) == before
    assert (checkpoints(base) / "latest").read_text().strip() == step.name


def test_zero_1_and_2_resume_each_others_checkpoints(reference, template, tmp_path):
    base = clone(template, tmp_path, parallel={"zero_stage": 1})
    ranks(1)(base, "--stop-after", str(STOP))
    _with_zero_stage(base, 2)
    out = ranks(1)(base)
    assert re.search(rf"stage2: resumed at step {STOP} ", out), out[-4000:]
    expected, got = train_log(reference()), train_log(base)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)


@pytest.mark.parametrize("names, kind", [
    (["mp_rank_00_model_states.pt"], "whole"),
    (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], "optimizer"),
    (["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], "parameters"),
])
def test_the_zero_stage_of_a_checkpoint_that_records_none_is_read_from_deepspeeds_files(tmp_path, names, kind):
    """What ZeRO-0, ZeRO-1/2 and ZeRO-3 engines write (the files of the runs above)."""
    from megatron_tc.distill.checkpointing import ENGINE_TAG, saved_zero_format

    (tmp_path / ENGINE_TAG).mkdir()
    for name in names:
        (tmp_path / ENGINE_TAG / name).write_bytes(b"")
    assert saved_zero_format(tmp_path, {"dp": 1}) == kind
    assert saved_zero_format(tmp_path, {"dp": 1, "zero": 3}) == "parameters"  # a recorded stage wins


def test_auto_keeps_the_zero_stage_of_the_checkpoint_it_resumes(reference, template, tmp_path):
    """parallel.zero_stage=auto picks ZeRO-0 for this student on one CPU rank; resuming a ZeRO-3
    checkpoint it keeps ZeRO-3 (which fits), since DeepSpeed loads it under that stage only."""
    base = clone(template, tmp_path, parallel={"zero_stage": 3})
    ranks(1)(base, "--stop-after", str(STOP))
    _with_zero_stage(base, "auto")
    out = ranks(1)(base)
    assert "parallel.zero_stage=auto over 1 data-parallel rank(s): ZeRO-3, the stage of the checkpoint it resumes" \
        in out, out[-4000:]
    assert re.search(rf"stage2: resumed at step {STOP} ", out), out[-4000:]
    expected, got = train_log(reference()), train_log(base)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
