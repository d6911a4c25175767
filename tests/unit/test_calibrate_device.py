"""The statistics pass and calibrate_student follow the teacher's device.

Each run happens inside `with torch.device("meta")`: a tensor created without an explicit device
(a CPU-only sum, a helper GDN layer, a student built on the default device) lands on `meta` and
the run fails or its numbers differ, so the CPU case already proves the code names its devices;
the CUDA cases (GPU machine) check the same on a real accelerator:
- "cuda": the same kernels as the CPU (the PyTorch chunked GDN path, eager element-wise blocks), so
  only the GEMMs' reduction order differs: the statistics are compared tightly, the trained student
  within 1% of what alignment moved each tensor (`student_mismatches` says why);
- "cuda-fla": what calibration runs by default on a GPU (fla's kernels, compiled blocks). fla's
  Triton kernels multiply fp32 in TF32, and Adam turns small relative differences of tiny gradients
  into full steps (H200: A_log of the aligned layer off by more than 1e-3 relative), so
  this case compares the statistics and the alignment losses, not the trained weights.
On CUDA the statistics are judged against an fp64 run of the same pass, every mismatch listed:
`conc` (1 - entropy / log n) cancels digits, so its fp32 rounding error is already 7e-5 relative on
the CPU, and the GPU's online-softmax entropy rounds differently (H200: 1.3e-6 absolute
off the CPU's fp32 value, 5e-4 relative).
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from megatron_tc.calibrate.moments import DENOMINATOR
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
    student, report = calibrate(teacher, batches)
    return stats, student, report


def calibrate(teacher, batches, align=ALIGN, calib_rows=3):
    return calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches[:calib_rows],
                             heldout_batches=batches[3:], align=align, progress=False)


def rows_on(device):
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    batches = [{"input_ids": ids[r:r + 1].to(device), "doc_ids": doc_ids[r:r + 1].to(device)} for r in range(4)]
    return teacher.to(device), batches


@pytest.fixture(scope="module")
def reference():
    teacher, batches = rows_on("cpu")
    stats, student, report = run(teacher, batches)
    stats_fp64, _, _ = run(teacher.double(), batches)
    untrained, _ = calibrate(teacher, batches, dataclasses.replace(ALIGN, steps=0))
    return stats, student, report, stats_fp64, untrained


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def stats_mismatches(got: dict, cpu: dict, fp64: dict, exact: bool) -> list[str]:
    """On the CPU the sums equal the reference run's bit for bit. Elsewhere each sum is at most 4x
    as far from the fp64 run as the CPU's fp32 sum is, plus 1e-6 relative (a wrong device, a lost
    batch or a mixed-up head gives errors of order 1). `conc` = 1 - H / log n with H / log n near 1
    cancels digits (H200: 5-18x the CPU's relative error, 1e-8 of the H / log n sum)."""
    bad = []
    for key, want in cpu.items():
        if exact:
            if not torch.equal(got[key], want):
                bad.append(f"{key}: differs from the reference CPU run ({rel(got[key], want):.3g} relative)")
            continue
        g, w, e = got[key], want, fp64[key]
        layer, _, name = key.rpartition(".")
        if name in ("conc", "conc_nosink"):  # judge 1 - H/log n by the sum of H/log n it is made of
            count = f"{layer}.{DENOMINATOR[name]}"
            g, w, e = got[count] - g, cpu[count] - w, fp64[count] - e
        err, base = rel(g, e), rel(w, e)
        if err > 4 * base + 1e-6:
            bad.append(f"{key}: {err:.3g} from fp64 > 4 x the CPU's {base:.3g} + 1e-6")
    return bad


def student_mismatches(got: dict, want: dict, untrained: dict, exact: bool) -> list[str]:
    """On the CPU the trained student equals the reference run's bit for bit. Elsewhere each tensor
    alignment moved must land within 1% of that move (|got - want| <= 0.01 |want - untrained|) and
    the others within 1e-6 relative. AdamW's early steps are lr * sign(g), so rounding noise of tiny
    gradients moves single elements by full steps: H200: g_proj off by 5.8e-5 of its
    move, which an element-wise 1e-5 bound rejected. Real errors move whole tensors: measured on CPU,
    one calibration row lost gives 0.7-1.8x the move, lr_proj 2e-3 instead of 3e-3 gives 0.33-1.03x."""
    bad = []
    for key, w in want.items():
        g = got[key]
        if exact:
            if not torch.equal(g, w):
                bad.append(f"{key}: differs from the reference CPU run ({rel(g, w):.3g} relative)")
            continue
        moved = (w.double() - untrained[key].double()).norm().item()
        off = (g.double() - w.double()).norm().item()
        if moved == 0:
            if off > 1e-6 * w.double().norm().item():
                bad.append(f"{key}: alignment left it alone, but it is {rel(g, w):.3g} relative off")
        elif off > 0.01 * moved:
            bad.append(f"{key}: {off / moved:.3g} of alignment's move off the reference (> 0.01)")
    return bad


@pytest.mark.parametrize("device", DEVICES)
def test_stats_and_calibration_follow_the_teacher_device(device, reference, monkeypatch):
    want_stats, want_student, want_report, stats_fp64, untrained = reference
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
    bad = stats_mismatches(stats.sums, want_stats.sums, stats_fp64.sums, exact)
    assert not bad, f"{len(bad)} statistics off:\n" + "\n".join(bad)
    if kernels == "cuda-fla":
        for layer, want in want_report["align"].items():
            got = report["align"][layer]
            assert got["initial"] == pytest.approx(want["initial"], rel=5e-3), layer
            assert got["best"] == pytest.approx(want["best"], rel=2e-2), layer
        return
    got_state = {k: v.cpu() for k, v in student.state_dict().items()}
    bad = student_mismatches(got_state, want_student.state_dict(), untrained.state_dict(), exact)
    assert not bad, f"{len(bad)} trained tensors off:\n" + "\n".join(bad)
    assert [r["best_step"] for r in report["align"].values()] == [r["best_step"] for r in want_report["align"].values()]
    assert any(r["best_step"] > 0 for r in report["align"].values()), "no optimizer step kept: weak test"


def test_the_device_check_flags_a_wrong_statistic(reference):
    """The CUDA cases' bound is loose enough for fp32 rounding and tight enough for a real error."""
    cpu, fp64 = reference[0].sums, reference[3].sums
    assert stats_mismatches(cpu, cpu, fp64, exact=False) == []
    key = "layers.0.conc_nosink"
    off = dict(cpu, **{key: cpu[key] * torch.tensor([1.0, 1.0, 2.0, 1.0])})  # one head counted twice
    assert [m.split(":")[0] for m in stats_mismatches(off, cpu, fp64, exact=False)] == [key]
    assert [m.split(":")[0] for m in stats_mismatches(off, cpu, fp64, exact=True)] == [key]


def test_the_device_check_flags_a_wrongly_trained_student(reference):
    """The CUDA case's bound on the trained student passes rounding and catches a lost calibration row."""
    want, untrained = reference[1].state_dict(), reference[4].state_dict()
    assert student_mismatches(want, want, untrained, exact=False) == []
    teacher, batches = rows_on("cpu")
    lost_row, _ = calibrate(teacher, batches, calib_rows=2)
    flagged = {m.split(":")[0] for m in student_mismatches(lost_row.state_dict(), want, untrained, exact=False)}
    moved = {k for k, v in want.items() if not torch.equal(v, untrained[k])}
    assert moved and flagged == moved
