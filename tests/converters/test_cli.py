"""The tools/ command lines, run as users run them (subprocesses), plus exit codes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.cli import reshard_main, verify_conversion_main
from tests.converters.families import random_hf_model
from tests.converters.test_student_export import random_student

ROOT = Path(__file__).resolve().parents[2]


def run_tool(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llama"
    random_hf_model("llama").save_pretrained(path)
    return path


def test_convert_verify_and_refuse_existing_output(llama_dir, tmp_path, capsys):
    out = tmp_path / "ck"
    done = run_tool("convert_hf_to_megatron.py", "--hf", llama_dir, "--out", out, "--tp", "2", "--pp", "2")
    assert done.returncode == 0, done.stderr
    assert f"wrote {out} (tp=2, pp=2) in" in done.stdout
    assert ckpt.read_info(out).tp == 2

    again = run_tool("convert_hf_to_megatron.py", "--hf", llama_dir, "--out", out, "--tp", "1", "--pp", "1")
    assert again.returncode == 2 and "already exists; pass overwrite=True (--overwrite" in again.stderr
    assert ckpt.read_info(out).tp == 2  # untouched

    assert verify_conversion_main(["--hf", str(llama_dir), "--ckpt", str(out), "--num-random", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
    other = tmp_path / "other"
    random_hf_model("llama", seed=5).save_pretrained(other)
    assert verify_conversion_main(["--hf", str(other), "--ckpt", str(out), "--num-random", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out

    assert reshard_main(["--ckpt", str(out), "--out", str(tmp_path / "r"), "--tp", "1", "--pp", "1"]) == 0
    assert reshard_main(["--ckpt", str(out), "--out", str(tmp_path / "r3"), "--tp", "3", "--pp", "1"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err


def test_student_export_cli_then_trust_remote_code_generate(tmp_path):
    model = random_student("AGGA", tied=True)
    ck = ckpt.save_checkpoint(model.state_dict(), model.arch, tmp_path / "ck", 1, 2)
    hf = tmp_path / "hf"
    done = run_tool("convert_megatron_to_hf.py", "--ckpt", ck, "--out", hf)
    assert done.returncode == 0, done.stderr
    assert (hf / "modeling_megatron_tc.py").is_file()
    ids = torch.randint(0, 300, (1, 6))
    script = (  # a fresh interpreter that never imports megatron_tc itself
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(hf)!r}, trust_remote_code=True, dtype=torch.float32)\n"
        f"out = m.generate(torch.tensor({ids.tolist()}), max_new_tokens=5, min_new_tokens=5, do_sample=False)\n"
        "print(type(m).__name__, out.tolist())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf_home")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    name, tokens = run.stdout.strip().splitlines()[-1].split(" ", 1)
    from megatron_tc.model import generate

    assert name == "MegatronTCForCausalLM"
    assert eval(tokens) == generate(model, ids, 5).tolist()
