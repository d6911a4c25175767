"""launch/distill.sh on a machine without GPUs starts the gloo ranks itself: each rank's
environment, the first failing rank's code as the launch's, and signals passed on to every rank.
The ranks are a stand-in interpreter (a shell script) that reports and obeys its environment."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

from tests.unit.test_launch import ROOT, SCRIPT, path_without

# prints its environment; sleeps SLEEP_<rank> s, then exits EXIT_<rank>; on SIGTERM says so and exits 143
FAKE_RANK = """#!/bin/bash
echo "rank $RANK local $LOCAL_RANK world $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT threads $OMP_NUM_THREADS args $*"
delay="SLEEP_$RANK"; code="EXIT_$RANK"
sleep "${!delay:-0}" &
trap 'kill $!; echo "rank $RANK got SIGTERM"; exit 143' TERM
wait $!
exit "${!code:-0}"
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_RANK)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {"PATH": path_without(tmp_path, "nvidia-smi"), "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHON": str(fake), "NPROC": "2", "MASTER_PORT": "4321", **extra}


def _launch(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "configs/x.yaml", "a=1"], env=env, capture_output=True, text=True,
                          timeout=60)


def test_every_rank_gets_its_rank_the_world_and_half_the_cores(tmp_path):
    proc = _launch(_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert sorted(proc.stdout.splitlines()) == [
        f"rank {r} local {r} world 2 at 127.0.0.1:4321 threads {threads} args {ROOT}/tools/distill.py configs/x.yaml a=1"
        for r in (0, 1)]


def test_the_first_rank_to_fail_ends_the_others_and_gives_its_code(tmp_path):
    start = time.monotonic()
    proc = _launch(_env(tmp_path, EXIT_1="3", SLEEP_0="40"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "rank 0 got SIGTERM" in proc.stdout
    assert time.monotonic() - start < 30  # rank 0 did not run out its 40 s


def test_sigterm_to_the_launch_reaches_every_rank(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as fh:
        proc = subprocess.Popen(["bash", str(SCRIPT), "configs/x.yaml"], env=_env(tmp_path, SLEEP_0="40", SLEEP_1="40"),
                                stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while out.read_text().count("world 2") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143, out.read_text()
    assert sorted(line for line in out.read_text().splitlines() if "SIGTERM" in line) == [
        "rank 0 got SIGTERM", "rank 1 got SIGTERM"]
