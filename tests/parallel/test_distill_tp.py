"""Stage 2 with tensor parallelism: TP=2 (2 gloo ranks, DP=1, ZeRO-3 with TP through mpu) trains
exactly as TP=1 on one process, and resumes exactly; stage 1 likewise, and in bf16 with an fp32 teacher."""
import json

import torch

from megatron_tc.testing import run_distributed
from tests.parallel import _workers_distill_tp
from tests.parallel._workers_common import assert_close, assert_same_weights


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same_series(got, want, key, what):
    """The `key` values of two logs within 1e-5 (relative, fp64: the logs hold full doubles)."""
    series = [torch.tensor([r[key] for r in records], dtype=torch.float64) for records in (got, want)]
    assert_close(*series, f"{what} {key}")


def test_tp2_stages_equal_one_process_and_stage2_resumes_exactly(tmp_path):
    """Stage 2: same losses (KL, CE, hidden), eval scores and gathered student as TP=1 (<= 1e-5
    relative); stop after 2 steps + resume == uninterrupted, bit for bit; DeepSpeed wrote one
    model-state partition per TP rank. Stage 1: same per-layer losses and merged student."""
    run_distributed(_workers_distill_tp.single_process, 1, str(tmp_path), timeout=180)
    run_distributed(_workers_distill_tp.tensor_parallel, 2, str(tmp_path), timeout=240)
    one, two, split = (tmp_path / name for name in ("tp1", "tp2", "tp2_split"))

    want, got = _records(one / "train_log.jsonl"), _records(two / "train_log.jsonl")
    assert [r["step"] for r in got] == list(range(1, _workers_distill_tp.STEPS + 1))
    for key in ("loss", "kl", "ce", "hidden", "grad_norm"):
        _same_series(got, want, key, "TP=2")
    assert all(r["ce"] > 0 and r["hidden"] > 0 for r in got)
    evals_1, evals_2 = _records(one / "eval_log.jsonl"), _records(two / "eval_log.jsonl")
    assert [e["step"] for e in evals_2] == [e["step"] for e in evals_1] == [0, 2, 4]
    for key in ("ppl", "kl", "top1_agree", "teacher_ppl"):
        _same_series(evals_2, evals_1, key, "TP=2 eval")

    student_1, student_2 = torch.load(one / "student.pt"), torch.load(two / "student.pt")
    assert_same_weights(student_2, student_1, "TP=2 gathered student")
    _, initial = _workers_distill_tp.teacher_and_student(0)
    assert not torch.equal(student_2["layers.1.mixer.A_log"], initial.state_dict()["layers.1.mixer.A_log"])

    resumed = _records(split / "train_log.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in got]
    assert _records(split / "eval_log.jsonl") == evals_2
    student_split = torch.load(split / "student.pt")
    for name, value in student_2.items():
        assert torch.equal(value, student_split[name]), name
    engine_files = sorted(p.name for p in (two / "checkpoints").glob("step_*/engine/*model_states.pt"))
    assert any("mp_rank_00" in n for n in engine_files) and any("mp_rank_01" in n for n in engine_files), engine_files
    _check_stage1(tmp_path, initial.state_dict())


def _check_stage1(root, initial):
    """Stage 1 under TP=2: same per-layer relative MSE and merged (gathered) student as TP=1."""
    want, got = _records(root / "s1_tp1/train_log.jsonl"), _records(root / "s1_tp2/train_log.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    for key in ("loss", "mse/L01", "mse/L03", "grad_norm"):
        _same_series(got, want, key, "stage1 TP=2")
    student_1, student_2 = torch.load(root / "s1_tp1/student.pt"), torch.load(root / "s1_tp2/student.pt")
    assert_same_weights(student_2, student_1, "stage1 TP=2 merged student")
    assert not torch.equal(student_2["layers.3.mixer.q_proj.weight"], initial["layers.3.mixer.q_proj.weight"])
    assert torch.equal(student_2["embed_tokens.weight"], initial["embed_tokens.weight"])  # not trained in stage 1


def test_stage1_bf16_engine_takes_inputs_from_an_fp32_teacher(tmp_path):
    run_distributed(_workers_distill_tp.stage1_bf16_with_fp32_teacher, 1, str(tmp_path), timeout=180)
