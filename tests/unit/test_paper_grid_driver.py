"""tools/experiments/paper_grid.py: the stage-2 and zero-shot grids share each (teacher, policy)'s
converted teacher and layer selection, in both directions, and never overwrite a cell's own."""
from __future__ import annotations

import json
from pathlib import Path

from tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    return load_script("tools/experiments/paper_grid.py")


def _grid(tmp_path: Path, part: str, inits: list[str]):
    from megatron_tc.eval.grid import load_grid

    data = {"base": str(ROOT / "configs" / "tiny.yaml"), "out": part, "mode": "zero_shot",
            "axes": {"teacher": {"t": "teacher"}, "policy": ["uniform", "ar"], "init": inits}}
    path = tmp_path / f"{part}.yaml"
    path.write_text(json.dumps(data))
    return load_grid(path)


def _finish_shared_stages(run_dir: str, selection: str) -> None:
    root = Path(run_dir)
    (root / "teacher").mkdir(parents=True)
    (root / "teacher" / "manifest.json").write_text("{}")
    (root / "select").mkdir()
    (root / "select" / "selection.json").write_text(selection)
    stages = {s: {"status": "complete", "fingerprint": s} for s in ("convert", "select", "stats")}
    (root / "manifest.json").write_text(json.dumps({"stages": stages}))


def test_zero_shot_and_stage2_cells_take_each_others_selection(tmp_path):
    driver = _driver()
    stage2, zero_shot = _grid(tmp_path, "stage2", ["naive", "ours"]), _grid(tmp_path, "zero_shot", ["zero_gate"])
    s2 = {c.key: c for c in stage2.cells()}
    zs = {c.key: c for c in zero_shot.cells()}
    _finish_shared_stages(s2["t/ar/naive"].run_dir, '{"keep": [1]}')  # stage 2 ran ar's selection
    _finish_shared_stages(zs["t/uniform/zero_gate"].run_dir, '{"keep": [0]}')  # zero-shot ran uniform's
    driver.reuse_outputs_across(zero_shot, stage2)
    driver.reuse_outputs_across(stage2, zero_shot)
    assert Path(zs["t/ar/zero_gate"].run_dir, "select", "selection.json").read_text() == '{"keep": [1]}'
    for init in ("naive", "ours"):
        assert Path(s2[f"t/uniform/{init}"].run_dir, "select", "selection.json").read_text() == '{"keep": [0]}'
    assert Path(s2["t/ar/ours"].run_dir, "select", "selection.json").read_text() == '{"keep": [1]}'
    stages = json.loads(Path(s2["t/uniform/ours"].run_dir, "manifest.json").read_text())["stages"]
    assert sorted(stages) == ["convert", "select"]  # stats depend on the init: never shared
    assert stages["select"]["reused_from"] == zs["t/uniform/zero_gate"].run_dir
    # a cell with its own selection keeps it
    assert Path(zs["t/uniform/zero_gate"].run_dir, "select", "selection.json").read_text() == '{"keep": [0]}'
