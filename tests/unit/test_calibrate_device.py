"""The statistics pass and calibrate_student follow the teacher's device.

Each run happens inside `with torch.device("meta")`: a tensor created without an explicit device
(a CPU-only sum, a helper GDN layer, a student built on the default device) lands on `meta` and
the run fails or its numbers differ, so the CPU case already proves the code names its devices;
the CUDA cases (device machine) check the same on a real accelerator:
- "cuda": the same kernels as the CPU (the PyTorch chunked GDN path, eager element-wise blocks), so
  only the GEMMs' reduction order differs, and every number is compared tightly;
- "cuda-fla": what calibration runs by default on a GPU (fla's kernels, compiled blocks). fla's
  Triton kernels multiply fp32 in TF32, and Adam turns small relative differences of tiny gradients
  into full steps (2026-11-29, H200: A_log of the aligned layer off by more than 1e-3 relative), so
  this case compares the statistics and the alignment losses, not the trained weights.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from megatron_tc.calibrate.stats import collect_stats
from megatron_tc.calibrate.strategies import AlignSettings, get_strategy
from megatron_tc.calibrate.student import calibrate_student
from tests.parallel._workers_stats import tiny_teacher_and_rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-fla", marks=pytest.mark.gpu)]
ALIGN = AlignSettings(steps=4, eval_every=2, lr_gates=3e-2, lr_proj=3e-3, batch_rows=3, best_on="train")


def run(teacher, batches):
    stats = collect_stats(teacher, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24},
                          readout_strategies=[get_strategy("taylor_fit")], student_arch=teacher.arch.with_pattern("GAG"),
                          chunk_size=5, progress=False)
    student, report = calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches[:3],
                                        heldout_batches=batches[3:], align=ALIGN, progress=False)
    return stats, student, report


def rows_on(device):
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    batches = [{"input_ids": ids[r:r + 1].to(device), "doc_ids": doc_ids[r:r + 1].to(device)} for r in range(4)]
    return teacher.to(device), batches


@pytest.fixture(scope="module")
def reference():
    return run(*rows_on("cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_stats_and_calibration_follow_the_teacher_device(device, reference, monkeypatch):
    want_stats, want_student, want_report = reference
    kernels = device
    device = device.split("-")[0]
    if kernels != "cuda-fla":  # the CPU's kernels (already so on the CPU: this checks the switch itself)
        # the subpackage, not the function of the same name that megatron_tc.model.ops exports
        gdr = importlib.import_module("megatron_tc.model.ops.gated_delta_rule")
        monkeypatch.setattr(gdr, "fla_available", lambda: False)
        monkeypatch.setenv("MEGATRON_TC_COMPILE", "0")
    teacher, batches = rows_on(device)
    with torch.device("meta"):  # poison the default device
        stats, student, report = run(teacher, batches)
    assert {v.device.type for v in stats.sums.values()} == {"cpu"}  # a finished pass hands out CPU sums
    assert {p.device.type for p in student.parameters()} == {device}
    assert {b.device.type for b in student.buffers()} == {device}
    exact = device == "cpu"
    for key, want in want_stats.sums.items():
        torch.testing.assert_close(stats.sums[key], want, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
    if kernels == "cuda-fla":
        for layer, want in want_report["align"].items():
            got = report["align"][layer]
            assert got["initial"] == pytest.approx(want["initial"], rel=5e-3), layer
            assert got["best"] == pytest.approx(want["best"], rel=2e-2), layer
        return
    got_state = {k: v.cpu() for k, v in student.state_dict().items()}
    for key, want in want_student.state_dict().items():
        torch.testing.assert_close(got_state[key], want, rtol=0 if exact else 1e-3, atol=0 if exact else 1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert [r["best_step"] for r in report["align"].values()] == [r["best_step"] for r in want_report["align"].values()]
    assert any(r["best_step"] > 0 for r in report["align"].values()), "no optimizer step kept: weak test"
