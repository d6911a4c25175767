"""`import megatron_tc` stays cheap and still makes the Auto classes know exported students."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import megatron_tc
heavy = [m for m in ("torch", "transformers", "deepspeed", "fla") if m in sys.modules]
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("megatron_tc_hybrid")
print(heavy, type(config).__name__, AutoModelForCausalLM._model_mapping[type(config)].__name__)
"""


def test_import_is_cheap_and_registers_lazily():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[] MegatronTCConfig MegatronTCForCausalLM"
