"""A statistics file applied to another teacher or to a layer pattern it did not measure is refused
with the reason; a damaged stats file is named. Real statistics pass on the tiny teacher."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.calibrate.statsfile import StatsMismatchError, TaylorStats, state_dict_sha256
from tests.reliability._rundir import teacher_and_student

MEASURED = [1, 3]  # the layers the stats file covers (pattern AGAG converts them)


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    from megatron_tc.calibrate.stats import collect_stats
    from megatron_tc.calibrate.strategies import get_strategy

    teacher, _ = teacher_and_student()
    sha = state_dict_sha256(teacher.state_dict())
    batches = [{"input_ids": torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    stats = collect_stats(teacher, batches, MEASURED, {"teacher_sha256": sha}, chunk_size=8, progress=False,
                          readout_strategies=[get_strategy("taylor")], student_arch=teacher.arch.with_pattern("AGAG"))
    path = tmp_path_factory.mktemp("stats") / "stats.pt"
    stats.save(path)
    return path, teacher, sha


def other_teacher():
    teacher, _ = teacher_and_student()
    with torch.no_grad():
        teacher.layers[2].mlp.down_proj.weight[0, 0] += 1e-3  # one weight differs: another teacher
    return teacher


def test_stats_of_another_teacher_are_refused(stats_file):
    from megatron_tc.calibrate.student import build_student

    path, _, sha = stats_file
    other = other_teacher()
    other_sha = state_dict_sha256(other.state_dict())
    assert other_sha != sha
    with pytest.raises(StatsMismatchError, match=rf"computed for teacher {sha[:12]}.*weights hash {other_sha[:12]}.*recompute"):
        TaylorStats.load(path, teacher_sha256=other_sha, converted_layers=MEASURED)
    stats = TaylorStats.load(path)
    with pytest.raises(StatsMismatchError, match="recompute"):
        build_student(other, "AGAG", "taylor", stats, teacher_sha256=other_sha)


def test_stats_for_another_layer_pattern_are_refused(stats_file):
    from megatron_tc.calibrate.student import build_student

    path, teacher, sha = stats_file
    with pytest.raises(StatsMismatchError, match=r"layers \[0\] are converted to GDN but the stats cover only layers \[1, 3\]"):
        TaylorStats.load(path, teacher_sha256=sha, converted_layers=[0, 1, 3])
    with pytest.raises(StatsMismatchError, match=r"layers \[2\] are converted"):
        build_student(teacher, "AGGG", "taylor", TaylorStats.load(path), teacher_sha256=sha)
    # the file's own teacher and pattern are accepted (the refusals above are not blanket ones)
    student = build_student(teacher, "AGAG", "taylor", TaylorStats.load(path, sha, MEASURED), teacher_sha256=sha)
    assert student.arch.layer_pattern == "AGAG"


def test_teacher_hash_does_not_depend_on_format_or_sharding(tmp_path):
    """Stats are keyed on the teacher's weights, so the HF teacher and its megatron_tc conversions
    at TP=1 and TP=2 (different vocabulary padding) must all match one stats file."""
    from megatron_tc.calibrate.teacher_io import load_teacher
    from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_tc.eval.tiny import save_hf, tiny_llama, word_tokenizer

    hf = save_hf(tmp_path / "hf", tiny_llama(vocab_size=40), word_tokenizer([f"w{i}" for i in range(38)]))
    hashes = {"hf": load_teacher(hf).sha256}
    for tp in (1, 2):
        convert_hf_to_megatron(hf, tmp_path / f"tp{tp}", tp=tp)
        hashes[f"tp{tp}"] = load_teacher(tmp_path / f"tp{tp}").sha256
    assert len(set(hashes.values())) == 1, hashes


@pytest.mark.parametrize("damage", ["truncated", "not a torch file", "empty"])
def test_damaged_stats_file_is_named(stats_file, tmp_path, damage):
    path, _, sha = stats_file
    bad = tmp_path / "stats.pt"
    data = path.read_bytes()
    bad.write_bytes({"truncated": data[: len(data) // 2], "not a torch file": b"hello", "empty": b""}[damage])
    with pytest.raises(StatsMismatchError, match=rf"{bad}"):
        TaylorStats.load(bad, teacher_sha256=sha, converted_layers=MEASURED)
