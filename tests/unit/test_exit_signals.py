"""megatron_tc.distill.signals in this process: a stop signal becomes a flag while handlers are in
force (and only then), nested handlers hand it outwards, bad names are refused before any work, and
a grid stops starting cells once one arrived (the running cell's pipeline stops at a checkpoint:
tests/reliability/test_exit_signal.py)."""
from __future__ import annotations

import json
import os
import signal

import pytest

from megatron_tc.config import ConfigError, load_config
from megatron_tc.distill.signals import ExitSignals, active, signal_numbers, stop_requested
from megatron_tc.eval.grid import CellStopped, load_grid, register_runner, run_grid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_listed_signal_sets_the_flag_and_the_default_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    assert stop_requested() is None and active() is None
    with ExitSignals(["SIGUSR1"]) as signals:
        assert active() is signals and stop_requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        assert signals.received == signal.SIGUSR1 and stop_requested() == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before and active() is None


def test_nested_handlers_tell_the_outer_one_and_restore_it():
    with ExitSignals(["SIGTERM", "USR2"]) as outer:
        with ExitSignals(["SIGUSR2"]) as inner:
            os.kill(os.getpid(), signal.SIGUSR2)
        assert inner.received == outer.received == signal.SIGUSR2
        assert active() is outer and signal.getsignal(signal.SIGUSR2) == outer._handle
    assert active() is None


@pytest.mark.parametrize("name", ["SIGKILL", "SIGFOO", "term"])
def test_signals_a_process_cannot_handle_are_refused(name):
    with pytest.raises(ValueError, match=f"'{name}' is not a signal a process can handle"):
        signal_numbers([name])
    with pytest.raises(ConfigError, match=r"run.exit_signals=.*is not a signal"):
        load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["model.teacher=x", f"run.exit_signals=[{name}]"])


STARTED, STOPPED = [], []


def stopping_runner(cfg, grid, cell):
    """taylor_calibrate's cell is stopped by a signal once, as a pipeline in a child process would be."""
    STARTED.append(cell.key)
    if cell.init == "taylor_calibrate" and not STOPPED:
        STOPPED.append(cell.key)
        os.kill(os.getpid(), signal.SIGTERM)
        raise CellStopped("stopped by SIGTERM with its state saved")
    return {"ppl": 10.0}


register_runner("stopping_for_test", stopping_runner)


def test_a_grid_starts_no_cell_after_a_stop_signal(tmp_path):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(json.dumps({
        "base": os.path.join(REPO, "configs", "tiny.yaml"), "out": "out", "mode": "stopping_for_test",
        "axes": {"teacher": {"t": "teacher"}, "policy": ["uniform"], "init": ["naive", "taylor_calibrate", "zero_gate"]}}))
    grid = load_grid(grid_file)
    STARTED.clear(), STOPPED.clear()
    records = run_grid(grid, log=lambda msg: None)
    assert STARTED == ["t/uniform/naive", "t/uniform/taylor_calibrate"]
    assert [r["status"] for r in records] == ["ok", "pending", "pending"]
    assert sorted(p.parent.name for p in (tmp_path / "out").rglob("cell.json")) == ["naive"]  # the stopped one resumes
    STARTED.clear()
    assert [r["status"] for r in run_grid(grid, log=lambda msg: None)] == ["ok", "ok", "ok"]
    assert STARTED == ["t/uniform/taylor_calibrate", "t/uniform/zero_gate"]
