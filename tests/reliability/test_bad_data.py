"""Bad data at the pipeline's data entry (`RunContext.data()`, what every stage calls): tokenizer
and vocabulary mismatches between teacher, student and data; empty files; non-UTF-8 bytes;
documents longer and shorter than the sequence length; too little text. Each is refused with a
message naming the problem before anything is written, or handled exactly."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from megatron_tc.data import IGNORE_INDEX, DataError
from tests.reliability._rundir import VOCAB, Job, clone


def run_context(base: Path, *overrides: str):
    """The pipeline's RunContext on <base>/run.yaml (one process: no process group needed)."""
    import torch

    from megatron_tc.config import load_config
    from megatron_tc.distill.context import RunContext
    from megatron_tc.distill.rundir import RunPaths

    cfg = load_config(base / "run.yaml", list(overrides))
    par = types.SimpleNamespace(rank=0, dp_rank=0, dp_size=1)
    return RunContext(cfg, RunPaths.from_config(cfg), par, torch.device("cpu"), tb=None)


@pytest.fixture()
def run(template, tmp_path) -> Path:
    return clone(template, tmp_path)


def other_tokenizer(tmp_path: Path, vocab_size: int) -> Path:
    from megatron_tc.data.synthetic import train_tiny_tokenizer

    return train_tiny_tokenizer(tmp_path / f"other_tok_{vocab_size}", vocab_size=vocab_size, seed=7)


def data_files_written(base: Path) -> list[str]:
    return sorted(p.name for p in (base / "run").iterdir() if p.name.startswith("data"))


# ---- tokenizer / vocabulary ------------------------------------------------------------------------

def test_data_tokenizer_larger_than_the_teacher_vocab_is_refused(run, tmp_path):
    ctx = run_context(run, f"data.tokenizer={other_tokenizer(tmp_path, VOCAB + 80)}")
    # Refused either as too large for the model or, first, as not the teacher's tokenizer.
    with pytest.raises(DataError, match=rf"tokenizer has {VOCAB + 80} tokens but the model has only {VOCAB}|"
                                        r"tokenizer mismatch: the teacher's tokenizer \(320 tokens"):
        ctx.data()
    assert data_files_written(run) == []


def test_data_tokenizer_other_than_the_teachers_is_refused(run, tmp_path):
    ctx = run_context(run, f"data.tokenizer={other_tokenizer(tmp_path, VOCAB)}")
    with pytest.raises(DataError, match="tokenizer mismatch"):
        ctx.data()


@pytest.fixture(scope="module")
def small_vocab_student_run(template, tmp_path_factory):
    """Stage 2 (real subprocess) with an init student whose vocabulary (300) is smaller than the
    teacher's (320); both checkpoints pad to 384 rows."""
    from megatron_tc.convert.checkpoint import read_info, save_checkpoint
    from tests.reliability._rundir import teacher_and_student

    base = clone(template, tmp_path_factory.mktemp("vocab"), steps=2)
    student_dir = base / "run/init/student"
    tokenizer = {p.name: p.read_bytes() for p in (student_dir / "tokenizer").iterdir()}
    _, student = teacher_and_student(vocab_size=300)
    save_checkpoint(student.state_dict(), student.arch, student_dir, tokenizer_files=tokenizer, overwrite=True)
    assert read_info(student_dir).arch.padded_vocab_size == read_info(base / "run/teacher").arch.padded_vocab_size
    job = Job(base, name="vocab")
    job.wait()
    return job


def test_student_with_another_vocabulary_is_refused_by_stage2(small_vocab_student_run):
    job = small_vocab_student_run
    assert job.proc.returncode != 0 and "vocab" in job.output().splitlines()[-1].lower(), job.output()[-2000:]


# ---- files ----------------------------------------------------------------------------------------

def test_empty_file_is_refused_naming_it_or_skipped_when_asked(run):
    empty = run / "run/text/zz_empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(DataError, match=rf"{empty}: the file is empty .*skip_empty"):
        run_context(run).data()
    assert data_files_written(run) == []
    data = run_context(run, "data.source.skip_empty=true").data()
    assert all(d.source != str(empty) for split in ("calibration", "train", "eval") for d in data.documents(split))


def test_non_utf8_bytes_are_refused_with_file_and_offset_or_replaced_when_asked(run):
    bad = run / "run/text/zz_latin1.txt"
    raw = "A caf\u00e9 menu.\n".encode() + "na\u00efve words here.\n".encode("latin-1")
    bad.write_bytes(raw)
    offset = raw.index(b"\xef")
    with pytest.raises(DataError, match=rf"{bad}: invalid UTF-8 at byte offset {offset}"):
        run_context(run).data()
    assert data_files_written(run) == []
    data = run_context(run, "data.source.on_decode_error=replace").data()
    texts = [d.text for split in ("calibration", "train", "eval") for d in data.documents(split) if d.source == str(bad)]
    assert texts == ["A caf\u00e9 menu.\nna\ufffdve words here.\n"]
    for split in ("calibration", "train", "eval"):
        data.token_stream(split)  # tokenizes (byte fallback) without error


def test_documents_longer_and_shorter_than_seq_len_are_packed_exactly(run):
    """One document of ~60 sequences, many of a single word: every input token of the split
    appears once, in order; labels never cross a document; positions restart per document."""
    text = run / "run/text"
    for p in text.iterdir():
        p.unlink()
    (text / "long.txt").write_text(" ".join(f"word{i % 97}" for i in range(1500)) + "\n")
    for i in range(40):
        (text / f"short{i:02d}.txt").write_text(f"w{i}\n")
    data = run_context(run, "data.split.calibration_fraction=0.1", "data.split.eval_fraction=0.1").data()
    seq = data.sequences("train", drop_last=False)
    stream = seq.stream
    rows = seq.batch(range(len(seq)))
    ids, labels, docs, pos = (rows[k].numpy() for k in ("input_ids", "labels", "doc_ids", "position_ids"))
    real = labels != IGNORE_INDEX
    flat_inputs = ids.reshape(-1)[: len(stream.tokens) - 1]
    assert np.array_equal(flat_inputs, stream.tokens[:-1])  # nothing dropped, nothing reordered
    same_doc = np.searchsorted(stream.offsets, np.arange(len(stream.tokens)), side="right") - 1
    t = np.arange(ids.size).reshape(ids.shape)[real]  # stream position of every labelled input
    assert np.array_equal(labels[real], stream.tokens[t + 1]) and np.all(same_doc[t] == same_doc[t + 1])
    starts = np.diff(docs, axis=1, prepend=-1) != 0
    assert np.all(pos[starts] == 0) and np.all(pos[:, 1:][~starts[:, 1:]] == pos[:, :-1][~starts[:, 1:]] + 1)
    assert max(stream.doc_lengths()) > 10 * seq.seq_len and min(stream.doc_lengths()) < seq.seq_len


def test_too_little_text_for_one_batch_is_refused_with_the_numbers(run):
    from megatron_tc.distill.runner import _loader

    ctx = run_context(run, "data.global_batch_size=4096")
    with pytest.raises(DataError, match=r"holds \d+ sequences of 16 tokens, fewer than one global batch \(4096\)"):
        _loader(ctx)
