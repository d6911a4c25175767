"""tools/stats.py, calibrate.py and select_layers.py: calibration text that shares a paragraph with
the evaluation text is refused before any work; a statistics file records the hashes of its text;
a strategy that needs held-out calibration rows gets them split from --text, or the tool refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_tc.calibrate.cli import calibrate_main, select_main, stats_main
from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.data.overlap import OverlapError, check_disjoint, paragraph_hashes, text_record
from megatron_tc.data.synthetic import synthetic_text

SHARED = ("The lighthouse keeper counted the ships that passed the rocks each night and wrote "
          "their names into a book that nobody else was allowed to read.")


def _paragraphs(seed: int, count: int) -> list[str]:
    return [synthetic_text(40, seed=seed * 100 + i).replace("\n", " ") for i in range(count)]


def _write(path: Path, paragraphs: list[str]) -> Path:
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def test_paragraph_hashes_normalise_and_ignore_headings():
    a = paragraph_hashes(f"CHAPTER I\n\n{SHARED}\n")
    rewrapped = SHARED.upper().replace(" the ", "\n  the ")
    b = paragraph_hashes(f"CHAPTER I\r\n\r\n{rewrapped}\n\nAnother paragraph that is long enough to count as one of its own.")
    assert len(a) == 1 and a < b  # the heading is too short to count; re-wrapping and case do not matter


def test_check_disjoint(tmp_path):
    calib = text_record(_write(tmp_path / "c.txt", _paragraphs(1, 5)))
    other = text_record(_write(tmp_path / "e.txt", _paragraphs(2, 5)))
    check_disjoint(calib, other)
    leaked = text_record(_write(tmp_path / "l.txt", _paragraphs(2, 5) + [_paragraphs(1, 5)[3]]))
    with pytest.raises(OverlapError, match="shares 1 paragraph"):
        check_disjoint(calib, leaked)
    with pytest.raises(OverlapError, match="shares all"):
        check_disjoint(text_record(_write(tmp_path / "s.txt", ["short"])), text_record(_write(tmp_path / "t.txt", ["short"])))


@pytest.mark.parametrize("main,extra", [
    (stats_main, ["--out", "x.pt"]),
    (calibrate_main, ["--init", "naive", "--keep", "0"]),
    (select_main, ["--policy", "uniform", "--out", "x.json"]),
])
def test_tools_refuse_overlapping_text_before_loading_anything(tmp_path, main, extra):
    calib = _write(tmp_path / "calib.txt", _paragraphs(1, 4) + [SHARED])
    evaluation = _write(tmp_path / "eval.txt", [SHARED] + _paragraphs(2, 4))
    args = ["--teacher", str(tmp_path / "no-such-teacher"), "--text", str(calib), "--eval-text", str(evaluation)]
    with pytest.raises(SystemExit, match=r"error: calibration text .*calib.txt shares 1 paragraph"):
        main(args + extra)


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron_tc.data.synthetic import train_tiny_tokenizer

    out = tmp_path_factory.mktemp("teacher")
    tok = AutoTokenizer.from_pretrained(str(train_tiny_tokenizer(out, vocab_size=320)))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def test_stats_file_records_its_text_and_calibrate_refuses_stats_of_evaluation_text(tmp_path, tiny_teacher):
    calib = _write(tmp_path / "calib.txt", _paragraphs(1, 12))
    stats_path = tmp_path / "stats.pt"
    common = ["--teacher", str(tiny_teacher), "--tokens", "64", "--seq-len", "32", "--no-progress"]
    assert stats_main(common + ["--text", str(calib), "--layers", "0", "--readout", "", "--out", str(stats_path)]) == 0
    record = TaylorStats.load(stats_path).meta["text_record"]
    assert record == text_record(calib) and record["paragraphs"] == 12
    # the stats were computed on what is now called the evaluation text: refused
    other = _write(tmp_path / "other.txt", _paragraphs(3, 12))
    with pytest.raises(SystemExit, match="calib.txt shares 12 paragraph"):
        calibrate_main(common + ["--text", str(other), "--eval-text", str(calib), "--stats", str(stats_path),
                                 "--init", "taylor", "--keep", "1"])


def test_taylor_fit_gets_heldout_rows_from_the_calibration_text_or_refuses(tmp_path, tiny_teacher):
    text = _write(tmp_path / "calib.txt", _paragraphs(1, 12))
    common = ["--teacher", str(tiny_teacher), "--text", str(text), "--seq-len", "32", "--no-progress",
              "--init", "taylor_fit", "--keep", "1", "--align-steps", "2"]
    out = tmp_path / "student"
    assert calibrate_main(common + ["--tokens", "64", "--out", str(out)]) == 0
    report = json.loads((out / "calibrate_report.json").read_text())
    assert report["align"]["0"]["best_step"] in (0, 2)  # held-out scores exist only at step 0 and every eval
    with pytest.raises(SystemExit, match=r"error: --init taylor_fit picks its best alignment step on held-out"):
        calibrate_main(common + ["--tokens", "100000"])


@pytest.mark.parametrize("main,extra", [
    (stats_main, ["--out", "x.pt"]),
    (calibrate_main, ["--init", "naive", "--keep", "0"]),
    (select_main, ["--policy", "uniform", "--out", "x.json"]),
])
def test_tools_name_a_missing_file_or_teacher_in_one_error_line(tmp_path, main, extra):
    calib = _write(tmp_path / "calib.txt", _paragraphs(1, 4))
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(SystemExit, match=r"^error: --text .*nope.txt: no such file; give the calibration text"):
        main(["--teacher", str(tmp_path), "--text", missing] + extra)
    with pytest.raises(SystemExit, match=r"^error: --eval-text .*nope.txt: no such file"):
        main(["--teacher", str(tmp_path), "--text", str(calib), "--eval-text", missing] + extra)
    with pytest.raises(SystemExit, match=r"^error: model path .*no-such-teacher' does not exist; give an HF"):
        main(["--teacher", str(tmp_path / "no-such-teacher"), "--text", str(calib)] + extra)


def test_a_stats_file_that_is_missing_or_of_another_teacher_is_one_error_line(tmp_path, tiny_teacher):
    calib = _write(tmp_path / "calib.txt", _paragraphs(1, 12))
    common = ["--teacher", str(tiny_teacher), "--text", str(calib), "--tokens", "64", "--seq-len", "32",
              "--no-progress", "--init", "taylor", "--keep", "1"]
    with pytest.raises(SystemExit, match=r"^error: --stats .*none.pt: no such file; give a stats file"):
        calibrate_main(common + ["--stats", str(tmp_path / "none.pt")])
    other = TaylorStats({"teacher_sha256": "0" * 64, "layers": [0]}, {})
    other.save(tmp_path / "other.pt")
    with pytest.raises(SystemExit, match=r"^error: stats were computed for teacher 0+. but the teacher given"):
        calibrate_main(common + ["--stats", str(tmp_path / "other.pt")])


def test_the_stats_policy_reads_a_stats_file_under_either_name_or_is_refused_before_the_teacher(tmp_path, tiny_teacher):
    """`--policy stats` (model.policy's name) is readout_gap; without --stats both names are one
    error line, before the teacher is read (here: a teacher path that does not exist)."""
    calib = _write(tmp_path / "calib.txt", _paragraphs(1, 12))
    for name in ("stats", "readout_gap"):
        with pytest.raises(SystemExit, match=r"^error: --policy stats \(readout_gap\) reads the statistics of every "
                                             r"layer: give --stats"):
            select_main(["--teacher", str(tmp_path / "no-such-teacher"), "--text", str(calib), "--policy", name,
                         "--out", str(tmp_path / "x.json")])
    common = ["--teacher", str(tiny_teacher), "--text", str(calib), "--tokens", "64", "--seq-len", "32",
              "--no-progress"]
    stats_path = tmp_path / "stats.pt"
    assert stats_main(common + ["--out", str(stats_path)]) == 0  # the defaults: every layer, every readout
    chosen = {}
    for name in ("stats", "readout_gap"):
        out = tmp_path / f"{name}.json"
        assert select_main(common + ["--policy", name, "--num-keep", "1", "--stats", str(stats_path),
                                     "--out", str(out), "--tb", str(tmp_path / f"tb-{name}")]) == 0
        chosen[name] = json.loads(out.read_text())
    assert chosen["stats"]["policy"] == "readout_gap" and len(chosen["stats"]["keep"]) == 1
    assert chosen["stats"]["keep"] == chosen["readout_gap"]["keep"]
    assert chosen["stats"]["scores"] == chosen["readout_gap"]["scores"]
    scores = {int(layer): score for layer, score in chosen["stats"]["scores"].items()}
    assert _scalars(tmp_path / "tb-stats", "select/score") == [(l, pytest.approx(scores[l])) for l in sorted(scores)]


def _scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_calibrate_writes_its_curves_and_perplexity_to_tensorboard(tmp_path, tiny_teacher):
    """--tb: every aligned layer's best loss and the student's perplexity on --eval-text, flushed
    when the tool ends."""
    calib, held = _write(tmp_path / "calib.txt", _paragraphs(1, 12)), _write(tmp_path / "eval.txt", _paragraphs(5, 6))
    out = tmp_path / "student"
    assert calibrate_main(["--teacher", str(tiny_teacher), "--text", str(calib), "--eval-text", str(held),
                           "--tokens", "64", "--seq-len", "32", "--no-progress", "--init", "taylor_calibrate",
                           "--keep", "1", "--align-steps", "2", "--eval-tokens", "64", "--out", str(out),
                           "--tb", str(tmp_path / "tb")]) == 0
    report = json.loads((out / "calibrate_report.json").read_text())
    assert _scalars(tmp_path / "tb", "eval/ppl") == [(0, pytest.approx(report["eval"]["ppl"], rel=1e-6))]
    assert [step for step, _ in _scalars(tmp_path / "tb", "align/best_relative_mse")] == report["converted"]
