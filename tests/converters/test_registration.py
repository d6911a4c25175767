"""`import megatron_tc` stays cheap and still makes the Auto classes know exported students."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


FIRST_TOUCH = """
import warnings
warnings.simplefilter("error")  # a failed registration warns
import megatron_tc
{first}
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("megatron_tc_hybrid")
print(AutoModelForCausalLM._model_mapping[type(config)].__name__)
"""


@pytest.mark.parametrize("first", [
    "from transformers import AutoModelForCausalLM",  # imports configuration_auto inside modeling_auto
    "import transformers as tf; tf.LlamaConfig(); tf.LlamaForCausalLM",  # Auto modules inside modeling_utils
    "from transformers import AutoTokenizer",
])
def test_registration_waits_for_the_enclosing_transformers_import(first):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", FIRST_TOUCH.format(first=first)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "MegatronTCForCausalLM"
