"""Bad input on a 2-rank launch (launch/distill.sh, gloo): one clear line per rank, no traceback.
A teacher path that does not exist, or a directory that is no model (its architecture is read on
every rank at start-up), is refused on every rank before any process group exists; a teacher whose
weights are missing fails on rank 0 in the convert stage, and rank 1 raises the same error instead
of waiting for rank 0 (`parallel.state.shared_outcome`)."""
from __future__ import annotations

import subprocess
import sys

from tests.reliability._rundir import ROOT, child_env


def launch(tmp_path, teacher) -> subprocess.CompletedProcess:
    from megatron_tc.data.synthetic import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "text", n_docs=4, words_per_doc=(20, 40))
    env = child_env()
    env.update(NPROC="2", PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "launch" / "distill.sh"), "configs/tiny.yaml", f"model.teacher={teacher}",
           f"data.source.paths=[{tmp_path / 'text'}]", f"run.run_dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def rank_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """Output lines of the ranks (the DeepSpeed launcher's own, `[2026-...`, and log records left out)."""
    return [line for line in (proc.stdout + proc.stderr).splitlines()
            if line and not line.startswith("[20") and " INFO " not in line]


def test_a_missing_teacher_is_one_config_error_line_on_every_rank(tmp_path):
    proc = launch(tmp_path, tmp_path / "no_such_teacher")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    expected = (f"config error: model.teacher={tmp_path / 'no_such_teacher'} does not exist: give an HF model "
                "directory, a .gguf file or a megatron_tc checkpoint")
    assert rank_lines(proc) == [expected, expected], proc.stderr[-3000:]


def test_a_directory_that_is_no_model_is_one_error_line_on_every_rank(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = launch(tmp_path, tmp_path / "empty")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    expected = f"{tmp_path / 'empty'} has no config.json and no .gguf file: not a Hugging Face model directory"
    assert sorted(rank_lines(proc)) == [f"error on rank 0: {expected}", f"error on rank 1: {expected}"], out[-3000:]


def test_a_failure_of_rank_0s_conversion_is_named_on_every_rank(tmp_path):
    from megatron_tc.testing import write_tiny_teacher

    teacher = write_tiny_teacher(tmp_path / "hf", n_docs=4) / "teacher"
    (teacher / "model.safetensors").unlink()  # its config reads on every rank; the weights, on rank 0
    proc = launch(tmp_path, teacher)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "Connection closed by peer" not in out, out[-3000:]
    expected = f"{teacher} has no model.safetensors(.index.json) or pytorch_model.bin(.index.json)"
    assert sorted(rank_lines(proc)) == [f"error on rank 0: {expected}", f"error on rank 1: {expected}"], out[-3000:]


def test_a_rank_says_its_line_in_one_write(monkeypatch):
    """Ranks share stderr: a line written in pieces (print writes its newline apart) can be split by
    another rank's line."""
    from megatron_tc.distill.cli import say

    class Stream:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    stream = Stream()
    monkeypatch.setattr(sys, "stderr", stream)
    say("config error: bad")
    assert stream.writes == ["config error: bad\n"]


def test_a_damaged_run_manifest_is_one_error_line_on_every_rank(tmp_path):
    from megatron_tc.testing import write_tiny_teacher

    teacher = write_tiny_teacher(tmp_path / "hf", n_docs=4) / "teacher"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text("[1, 2]\n")  # JSON, but not a manifest
    proc = launch(tmp_path, teacher)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    expected = (f"{tmp_path / 'run' / 'manifest.json'} is not a megatron_tc run manifest (a JSON object whose "
                "'stages' maps each stage to an object); delete it to rerun every stage")
    assert sorted(rank_lines(proc)) == [f"error on rank 0: {expected}", f"error on rank 1: {expected}"], out[-3000:]
