"""Student-forced alignment (calibrate/sequential.py): each converted layer trains on the inputs the
partly converted student feeds it, bottom to top; the first converted layer sees the teacher's inputs."""
import dataclasses

import pytest
import torch

from megatron_tc.calibrate.align import LayerData, collect_layer_io, relative_mse
from megatron_tc.calibrate.capture import capture_layers
from megatron_tc.calibrate.sequential import ResidualStream, align_student_forced
from megatron_tc.calibrate.strategies import AlignSettings, get_strategy
from megatron_tc.calibrate.student import build_student, calibrate_student
from tests.parallel._workers_stats import row_batches, stats_of_rows, tiny_teacher_and_rows

PATTERN = "GAG"  # layers 0 and 2 converted, layer 1 kept
SETTINGS = AlignSettings(steps=6, lr_gates=1e-2, lr_proj=1e-3, eval_every=2, best_on="heldout")


@pytest.fixture(scope="module")
def setup():
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    return teacher, stats_of_rows(range(4)), row_batches(ids, doc_ids, range(4))


def _calibrated(setup, forcing):
    teacher, stats, batches = setup
    return calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches[:3], heldout_batches=batches[3:],
                             stats=stats, teacher_sha256="t", align=dataclasses.replace(SETTINGS, forcing=forcing),
                             progress=False)


def _student_forced_rows(student, teacher, batches, layer, forcing):
    """Layer `layer`'s held-out data computed independently: the aligned student's own forward
    (capture hooks) for inputs, the teacher's for targets."""
    xs, resid = [], []
    for b in batches:
        capture_layers(student, b["input_ids"], b["doc_ids"], [layer],
                       lambda i, io: (xs.append(io.x.float()), resid.append(io.resid.float())))
    ref = collect_layer_io(teacher, batches, [layer], keep_resid=True)[layer]
    y = ref.y if forcing == "student" else ref.y + ref.resid - torch.cat(resid)
    return LayerData(torch.cat(xs), y, torch.cat([b["doc_ids"] for b in batches]))


@pytest.mark.parametrize("forcing", ["student", "residual"])
def test_first_layer_equals_teacher_forced_and_upper_layer_trains_on_student_inputs(setup, forcing):
    teacher, _, batches = setup
    forced, _ = _calibrated(setup, "teacher")
    student, report = _calibrated(setup, forcing)
    assert report["align_forcing"] == forcing
    # nothing is converted below layer 0: its inputs and targets are the teacher's, so it aligns identically
    for name, want in forced.layers[0].mixer.state_dict().items():
        torch.testing.assert_close(student.layers[0].mixer.state_dict()[name], want, rtol=0, atol=0, msg=name)
    # layer 2 sees layer 0's approximation: its held-out score is on the student's own inputs
    held = _student_forced_rows(student, teacher, batches[3:], 2, forcing)
    best = report["align"]["2"]["best"]
    assert abs(relative_mse(student.layers[2].mixer, held) - best) < 1e-5 * max(1.0, best)
    teacher_held = collect_layer_io(teacher, batches[3:], [2])[2]
    assert not torch.allclose(held.x, teacher_held.x)
    assert not torch.equal(student.layers[2].mixer.q_proj.weight, forced.layers[2].mixer.q_proj.weight)


def test_residual_stream_matches_the_models_own_forward(setup):
    teacher, _, batches = setup
    student = build_student(teacher, PATTERN, "naive", teacher_sha256="t")
    stream = ResidualStream(student, batches[:2])
    stream.advance_to(2)
    for h, b in zip(stream.h, batches[:2]):
        seen = []
        capture_layers(student, b["input_ids"], b["doc_ids"], [2], lambda i, io: seen.append(io.resid))
        torch.testing.assert_close(h, seen[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot go back"):
        stream.advance_to(1)


def test_registered_strategies_and_bad_settings(setup):
    teacher, stats, batches = setup
    assert get_strategy("taylor_fit-seq").align.forcing == "student"
    assert get_strategy("taylor_fit-seqres").align.forcing == "residual"
    assert get_strategy("taylor_fit-seq").readout_name == "taylor_fit"  # taylor_fit's closed form and statistics
    student = build_student(teacher, PATTERN, "taylor_fit", stats, teacher_sha256="t")
    with pytest.raises(ValueError, match="forcing 'student' or 'residual'"):
        align_student_forced(student, teacher, [0, 2], dataclasses.replace(SETTINGS, forcing="sideways"), batches)
    sandwich = dataclasses.replace(student.arch, sandwich_norm=True)
    student.arch = sandwich
    with pytest.raises(ValueError, match="sandwich"):
        align_student_forced(student, teacher, [0, 2], dataclasses.replace(SETTINGS, forcing="residual"), batches)
