"""Tiny run directories for the reliability tests, and real `tools/distill.py` subprocesses on them.

`build_template(dir)` writes a teacher and an init student directly as megatron_tc checkpoints (no
convert/stats/init stages), a sentencepiece tokenizer and a text corpus; `clone(template, dir)`
copies it and writes `run.yaml` for the copy, so every scenario starts from the same files.
Everything is random and tiny (hidden 32, 4 layers, vocab 320): one stage-2 step takes
milliseconds and a subprocess spends its time importing torch and DeepSpeed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
DISTILL = ROOT / "tools" / "distill.py"
VOCAB = 320
STEPS = 12  # stage-2 steps of the runs below; checkpoints and evaluations every 2 steps


def tiny_arch(pattern: str, vocab_size: int = VOCAB):
    from megatron_tc.model.config import ArchConfig

    return ArchConfig(family="llama", vocab_size=vocab_size, hidden_size=32, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64, layer_pattern=pattern, tie_embeddings=True,
                      gdn_chunk_size=8)


def teacher_and_student(vocab_size: int = VOCAB):
    """A random all-attention teacher and an AGAG student with the teacher's matching tensors."""
    from megatron_tc.model.transformer import HybridLM

    torch.manual_seed(0)
    teacher = HybridLM(tiny_arch("AAAA", vocab_size), init_std=0.1)
    student = HybridLM(tiny_arch("AGAG", vocab_size))
    own = student.state_dict()
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if k in own and own[k].shape == v.shape},
                            strict=False)
    return teacher, student


def build_template(base: Path) -> Path:
    """<base>/tokenizer (HF dir), <base>/run/{teacher, init/student, text}; returns base."""
    from megatron_tc.convert.checkpoint import save_checkpoint
    from megatron_tc.data.synthetic import train_tiny_tokenizer, write_synthetic_corpus

    run = base / "run"
    tok = train_tiny_tokenizer(base / "tokenizer", vocab_size=VOCAB)
    tok_files = {p.name: p.read_bytes() for p in tok.iterdir() if p.is_file()}
    write_synthetic_corpus(run / "text", n_docs=24, words_per_doc=(40, 200), seed=3)
    teacher, student = teacher_and_student()
    save_checkpoint(teacher.state_dict(), teacher.arch, run / "teacher", tokenizer_files=tok_files)
    save_checkpoint(student.state_dict(), student.arch, run / "init" / "student", tokenizer_files=tok_files)
    return base


def write_config(base: Path, steps: int = STEPS, **sections: Any) -> Path:
    """<base>/run.yaml: configs/tiny.yaml running only stage2 on <base>/run."""
    run = base / "run"
    config = {
        "base": str(ROOT / "configs" / "tiny.yaml"),
        "run": {"run_dir": str(run), "stages": ["stage2"]},
        "model": {"teacher": str(run / "teacher")},
        "data": {"source": {"kind": "text", "paths": [str(run / "text")], "split_by": "file"},
                 "seq_len": 16, "global_batch_size": 2, "micro_batch_size": 1, "eval_tokens": 64},
        "distill": {"stage2": {"steps": steps, "lr": 3.0e-3, "warmup_steps": 1},
                    "eval_interval": 2, "checkpoint_interval": 2, "keep_last": 2},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    path = base / "run.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def clone(template: Path, base: Path, **config: Any) -> Path:
    """A fresh copy of the template's run directory at <base>/run with its own run.yaml."""
    base.mkdir(parents=True, exist_ok=True)
    shutil.copytree(template / "run", base / "run")
    write_config(base, **config)
    return base


# ---- subprocesses --------------------------------------------------------------------------------

def child_env(faults: str | None = None) -> dict[str, str]:
    """This environment minus any launcher variables (the child is a world of one), one thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "MEGATRON_TC_FAULTS")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    if faults:
        env["MEGATRON_TC_FAULTS"] = faults
    return env


class Job:
    """`python tools/distill.py <base>/run.yaml [overrides]` running in the background."""

    def __init__(self, base: Path, *overrides: str, faults: str | None = None, name: str = "job"):
        self.base, self.name = base, name
        self.log_path = base / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(DISTILL), str(base / "run.yaml"), *overrides],
                                         cwd=ROOT, env=child_env(faults), stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not finish within {timeout} s:\n{self.output()[-3000:]}")

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def finished_ok(self, timeout: float = 300) -> "Job":
        rc = self.wait(timeout)
        assert rc == 0, f"{self.name} exited with {rc}:\n{self.output()[-4000:]}"
        return self


def wait_for_records(path: Path, count: int, job: Job, timeout: float = 300) -> int:
    """Poll the JSONL file until it holds >= `count` lines (or the job ended); returns the count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = len(path.read_text().splitlines()) if path.is_file() else 0
        if n >= count or job.proc.poll() is not None:
            return n
        time.sleep(0.005)
    raise AssertionError(f"{path} did not reach {count} records within {timeout} s")


# ---- reading a run's results ---------------------------------------------------------------------

def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_log(base: Path) -> list[dict]:
    """stage2/train_log.jsonl without the wall-clock field."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records(base / "run/stage2/train_log.jsonl")]


def final_student(base: Path) -> dict[str, torch.Tensor]:
    from megatron_tc.convert.checkpoint import load_checkpoint

    return load_checkpoint(base / "run/stage2/student")[1]


def checkpoints(base: Path) -> Path:
    return base / "run/stage2/checkpoints"


def assert_same_run(expected: Path, got: Path) -> None:
    """Same per-step losses/lr/grad norms, same evaluations, bit-identical final student."""
    a, b = train_log(expected), train_log(got)
    assert [r["step"] for r in b] == list(range(1, len(a) + 1)), [r["step"] for r in b]
    assert json.dumps(a) == json.dumps(b), (a, b)  # json: NaN == NaN, exact floats
    assert records(expected / "run/eval_log.jsonl") == records(got / "run/eval_log.jsonl")
    sa, sb = final_student(expected), final_student(got)
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"final weights differ from the uninterrupted run: {different}"
