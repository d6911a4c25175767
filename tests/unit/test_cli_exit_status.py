"""Bad input to any command-line tool: one `error:` line on stderr (argparse's `prog: error:` for
its own checks), exit status 2, no traceback (megatron_tc.config.errors: 2 bad input, 1 a failure
of the work)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_tc.config.errors import InputError, command_line
from tests._scripts import ROOT


def test_command_line_writes_the_line_once_and_exits_2(capsys):
    @command_line
    def main(argv):
        if argv:
            raise InputError(f"error: --flag {argv[0]!r}: give a number")
        return 0

    assert main([]) == 0 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as stop:
        main(["x"])
    assert stop.value.code == 2 and str(stop.value) == "error: --flag 'x': give a number"
    assert capsys.readouterr().err == "error: --flag 'x': give a number\n"


def test_other_errors_pass_through_command_line_unchanged(capsys):
    @command_line
    def main():
        raise RuntimeError("a failure of the work")

    with pytest.raises(RuntimeError, match="a failure of the work"):
        main()
    assert capsys.readouterr().err == ""


def _bad_inputs(tmp) -> dict[str, tuple[list[str], str]]:
    """tool -> (its command with one bad input, what its error line says)."""
    text = tmp / "calib.txt"
    text.write_text("Some calibration text.\n\nA second paragraph of it.\n")
    missing, py = str(tmp / "nope.txt"), sys.executable
    return {
        "tools/stats.py": ([py, "tools/stats.py", "--teacher", str(tmp), "--text", missing, "--out", "x.pt"],
                           "--text"),
        "tools/calibrate.py": ([py, "tools/calibrate.py", "--teacher", str(tmp / "none"), "--text", str(text),
                                "--init", "naive", "--keep", "0", "--out", str(tmp / "out")], "does not exist"),
        "tools/select_layers.py": ([py, "tools/select_layers.py", "--teacher", str(tmp), "--text", str(text),
                                    "--eval-text", missing, "--policy", "uniform", "--out", "x.json"], "--eval-text"),
        "tools/report.py": ([py, "tools/report.py", str(tmp / "no-run"), "--out", str(tmp / "report"), "--ks", "1.1,x"],
                            "--ks"),
        "tools/run_grid.py": ([py, "tools/run_grid.py", str(tmp / "none.yaml")], "none.yaml"),
        "tools/evaluate.py": ([py, "tools/evaluate.py", "--model", str(tmp / "none"), "--text", str(text),
                                "--seq-len", "16", "--max-tokens", "32"], "none"),
        "tools/paper/report.py": ([py, "tools/paper/report.py", "--policies", "bogus", "--out", str(tmp / "p")],
                                  "--policies"),
        "tools/paper/grid.py": ([py, "tools/paper/grid.py", "grid", "--kind", "small", "--teacher", "t=x",
                                 "--parts", "nope", "--out", str(tmp / "g")], "--parts"),
        "eval.long_context": ([py, "-m", "megatron_tc.eval.long_context", "--model", str(tmp / "none"),
                               "--lengths", "6x4"], "--lengths"),
        "eval.harness": ([py, "-m", "megatron_tc.eval.harness", "--model", str(tmp / "none"), "--tasks", "x"],
                         "--model"),
    }


def test_every_tool_reports_bad_input_in_one_line_with_status_2(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cases = _bad_inputs(tmp_path)
    running = {tool: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for tool, (cmd, _) in cases.items()}
    wrong = []
    for tool, proc in running.items():
        out, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        said = cases[tool][1]
        ok = (proc.returncode == 2 and "Traceback" not in err and len(lines) == 1
              and re.match(r"([\w./]+: )?error: ", lines[0]) is not None and said in lines[0])
        if not ok:
            wrong.append(f"{tool}: status {proc.returncode}, stderr {err[-1500:]!r}")
    assert not wrong, "\n".join(wrong)
