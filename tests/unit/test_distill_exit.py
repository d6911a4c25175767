"""tools/distill.py's process entry (`process_main`): what outlives the run is frozen for the
garbage collector, so interpreter finalization does not traverse it, and nothing the run writes at
its end is lost: TensorBoard's last scalars, the last checkpoint, the manifest."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.reliability._rundir import ROOT, build_template, child_env, clone

PROBE = """
import gc, json, sys
from megatron_tc.distill.cli import process_main
rc = process_main([sys.argv[1]])
print(json.dumps({"rc": rc, "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}))
"""


def test_process_main_freezes_what_outlives_the_run_and_loses_no_output(tmp_path):
    base = clone(build_template(tmp_path / "template"), tmp_path / "job", steps=4)
    done = subprocess.run([sys.executable, "-c", PROBE, str(base / "run.yaml")], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["rc"] == 0
    # torch, DeepSpeed and the run's survivors: hundreds of thousands frozen, next to nothing left to scan
    assert probe["frozen"] > 100_000 and probe["tracked"] < 1_000, probe

    run = base / "run"
    assert json.loads((run / "manifest.json").read_text())["stages"]["stage2"]["status"] == "complete"
    assert (run / "stage2" / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("stage2/kl")][-1] == 4, acc.Tags()["scalars"]
