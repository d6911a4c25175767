"""The statistics pass's Triton kernels (sweep 1's moments, sweep 2's read sums and value grid)
against their PyTorch references, run in Triton's interpreter on the CPU.

Triton must not be importable in the project's environment (requirements.txt says why), so
tools/setup_env.sh installs it into a folder of its own (.cache/triton-3.6.0, with the numpy < 2.4
its interpreter needs) and this test runs the kernels' test files in a subprocess with that folder
first on the path and TRITON_INTERPRET=1. To run them by hand:

    PYTHONPATH=.cache/triton-3.6.0 TRITON_INTERPRET=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q \\
        tests/unit/test_calibrate_stats_kernel.py tests/unit/test_read_sums_kernel.py \\
        tests/unit/test_value_grid_kernel.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_VERSION = "3.6.0"
KERNEL_TESTS = ("tests/unit/test_calibrate_stats_kernel.py", "tests/unit/test_read_sums_kernel.py",
                "tests/unit/test_value_grid_kernel.py")


def triton_folder() -> Path:
    """A --target folder holding triton: $MEGATRON_TC_TRITON_INTERPRETER, else the one
    tools/setup_env.sh makes."""
    given = os.environ.get("MEGATRON_TC_TRITON_INTERPRETER")
    path = Path(given) if given else ROOT / ".cache" / f"triton-{TRITON_VERSION}"
    if not (path / "triton").is_dir():
        pytest.skip(f"triton {TRITON_VERSION} not found at {path}: run tools/setup_env.sh, or pip install "
                    f"--no-deps --target DIR triton=={TRITON_VERSION} numpy==2.3.5 and set "
                    "MEGATRON_TC_TRITON_INTERPRETER=DIR")
    return path


def test_the_triton_kernels_equal_their_references_in_the_interpreter():
    folder = triton_folder()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    env.pop("MEGATRON_TC_STATS_KERNEL", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    summary = run.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    # every case runs: none may skip for want of triton or the interpreter
    assert passed and int(passed.group(1)) >= 26 and "skipped" not in summary, report
