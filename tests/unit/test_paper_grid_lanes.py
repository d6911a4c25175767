"""tools/experiments/paper_grid_gpu.sh's `lanes:` step: steps run side by side, each lane's output
marked, a failing lane's exit code comes back, and steps that must not run twice at once are
refused. (The full end-to-end run in two lanes, pretraining and grids at --quick sizes, is in
docs/RESULTS.md: about a minute, too long for the suite.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "experiments" / "paper_grid_gpu.sh"


def run(tmp_path: Path, *steps: str) -> subprocess.CompletedProcess:
    # CARRIED: not the checkout's .paper_runs, which holds real teachers once a device call returned them
    env = dict(os.environ, R=str(tmp_path / "r"), OUT=str(tmp_path / "out"), PYTHON=sys.executable, BUDGET_S="120",
               CARRIED=str(tmp_path / "carried"))
    return subprocess.run(["bash", str(SCRIPT), "--quick", *steps], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_lanes_run_every_step_mark_their_output_and_return_a_failure(tmp_path):
    done = run(tmp_path, "lanes:pretrain:nosuch+grid:qwen2")
    out = done.stdout
    assert done.returncode != 0, out
    assert "[lane 0] " in out and "[lane 1] " in out, out
    assert "[lane 0] " in next(l for l in out.splitlines() if "unknown teacher nosuch" in l)
    assert "[lane 1] " in next(l for l in out.splitlines() if "grid qwen2: no teacher" in l)
    assert "lane 0 (pretrain:nosuch): exit 2" in out and "lane 1 (grid:qwen2): exit 1" in out


def test_a_lane_runs_its_slash_separated_steps_in_order(tmp_path):
    """lanes:A/B+C: lane 0 runs A then B (B runs although A failed), lane 1 runs C."""
    done = run(tmp_path, "lanes:grid:qwen2/pretrain:nosuch+grid:mistral")
    lane0 = [l for l in done.stdout.splitlines() if l.startswith("[lane 0] ")]
    assert done.returncode != 0, done.stdout
    first = next(i for i, l in enumerate(lane0) if "grid qwen2: no teacher" in l)
    second = next(i for i, l in enumerate(lane0) if "unknown teacher nosuch" in l)
    assert first < second, done.stdout
    assert any("grid mistral: no teacher" in l for l in done.stdout.splitlines() if l.startswith("[lane 1] "))
    assert "lane 0: grid:qwen2 pretrain:nosuch" in done.stdout


def test_lanes_refuse_steps_that_share_state(tmp_path):
    done = run(tmp_path, "lanes:grid:qwen2+pack")
    assert done.returncode == 2 and "lanes: pack cannot run in a lane" in done.stdout
    assert "[lane" not in done.stdout  # nothing started
    done = run(tmp_path, "lanes:grid:qwen2/restore+grid:mistral")  # also as a later step of a lane
    assert done.returncode == 2 and "lanes: restore cannot run in a lane" in done.stdout
    assert "[lane" not in done.stdout


def test_kernel_cache_packs_into_parts_and_unpacks_identically(tmp_path):
    """pack_kcache splits the compiled-kernel cache into parts a device call can return; kcache
    puts the carried parts back in a fresh cache directory byte for byte."""
    cache = tmp_path / "kc"
    (cache / "triton" / "ab").mkdir(parents=True)
    payload = os.urandom(3 * 1024 * 1024)  # incompressible: the split must carry every byte
    (cache / "triton" / "ab" / "kernel.cubin").write_bytes(payload)
    env = dict(os.environ, R=str(tmp_path / "r"), OUT=str(tmp_path / "carried_parts"), PYTHON=sys.executable,
               KCACHE=str(cache))
    packed = subprocess.run(["bash", str(SCRIPT), "--quick", "pack_kcache"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert packed.returncode == 0 and "pack_kcache: 1 part(s)" in packed.stdout, packed.stdout + packed.stderr
    fresh = tmp_path / "fresh"
    env.update(KCACHE=str(fresh), KCACHE_CARRIED=str(tmp_path / "carried_parts"))
    restored = subprocess.run(["bash", str(SCRIPT), "--quick", "kcache"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert (fresh / "triton" / "ab" / "kernel.cubin").read_bytes() == payload
    env.update(KCACHE_CARRIED=str(tmp_path / "none"))
    nothing = subprocess.run(["bash", str(SCRIPT), "--quick", "kcache"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert nothing.returncode == 0 and "kcache: nothing carried" in nothing.stdout
