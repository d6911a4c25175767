"""What a grid cell leaves on disk, and which of it a sibling cell may take.

A finished cell writes `<cell>/cell.json` (`finished_record` reads it back); the pipeline inside a
cell keeps `<cell>/manifest.json` (`read_manifest`). Cells of one (teacher, policy) share their
convert and select outputs, and cells of one init (in grids that differ in what comes after) also
their statistics and init; an output is shared only when its fingerprint is the one the taking
cell's pipeline will require (`Cell.fingerprints`) and its files are on this machine.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

from megatron_tc.eval.report import atomic_write_text

if TYPE_CHECKING:
    from megatron_tc.eval.grid import Cell

CELL_FILE = "cell.json"
SHARED_STAGES = {"convert": "teacher", "select": "select"}  # stage -> its directory in a run dir
SAME_INIT_STAGES = {"stats": "stats", "init": "init"}  # shared only between cells of one init


def shared_stages(cell: Cell, sibling: Cell) -> dict[str, str]:
    """The stages `cell` may take from `sibling` (same teacher and policy): convert and select
    always, stats and init when both start from the same init (cells of grids that differ in what
    comes after, such as the stage-2 recipe). The fingerprint check still decides whether they apply."""
    return {**SHARED_STAGES, **(SAME_INIT_STAGES if sibling.init == cell.init else {})}


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (stage outputs are written once, by rename, never modified in place), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def read_manifest(run_dir: str) -> dict[str, Any]:
    """A run dir's manifest.json; none, or one that does not parse, shares nothing (the pipeline
    reports a broken manifest when that cell itself runs)."""
    try:
        with open(os.path.join(run_dir, "manifest.json"), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return {"stages": {}}
    return data if isinstance(data, dict) and isinstance(data.get("stages"), dict) else {"stages": {}}


def reuse_sibling_stages(cell: Cell, sibling: Cell) -> list[str]:
    """Link `sibling`'s complete shared outputs (`shared_stages`) into `cell` (of the same teacher and
    policy) with their manifest entries; returns the stages reused. A stage the cell already has is
    never touched; one the sibling has not completed (or whose files did not travel with a packed
    result, like `teacher/` or `init/student/`) is left for the pipeline to run."""
    theirs, mine = read_manifest(sibling.run_dir), read_manifest(cell.run_dir)
    reused = []
    for stage, sub in shared_stages(cell, sibling).items():
        entry = theirs["stages"].get(stage, {})
        src, dst = os.path.join(sibling.run_dir, sub), os.path.join(cell.run_dir, sub)
        if (stage in mine["stages"] or not _applies(cell, stage, entry) or not os.path.isdir(src)
                or os.path.exists(dst)):
            continue
        shutil.copytree(src, dst, copy_function=_link_or_copy)
        mine["stages"][stage] = {**entry, "outputs": [o.replace(sibling.run_dir, cell.run_dir, 1)
                                                      for o in entry.get("outputs", [])],
                                 "reused_from": sibling.run_dir}
        reused.append(stage)
    if reused:
        atomic_write_text(os.path.join(cell.run_dir, "manifest.json"), json.dumps(mine, indent=2, sort_keys=True) + "\n")
    return reused


def _complete_here(entry: dict[str, Any]) -> bool:
    """A manifest entry marked complete whose recorded outputs are all on this machine."""
    return entry.get("status") == "complete" and all(os.path.exists(o) for o in entry.get("outputs", []))


def _applies(cell: Cell, stage: str, entry: dict[str, Any]) -> bool:
    """A complete entry here whose fingerprint is the one `cell`'s pipeline will require (when known)."""
    return _complete_here(entry) and (cell.fingerprints is None or entry.get("fingerprint") == cell.fingerprints.get(stage))


def _shareable(cell: Cell, sibling: Cell) -> list[str]:
    """The stages `cell` may take from `sibling` that the sibling has complete here, for `cell`'s config."""
    stages = read_manifest(sibling.run_dir)["stages"]
    return [s for s in shared_stages(cell, sibling) if _applies(cell, s, stages.get(s, {}))]


def _siblings(cells: list[Cell], cell: Cell) -> list[Cell]:
    return [c for c in cells if (c.teacher, c.policy) == (cell.teacher, cell.policy) and c is not cell]


def sibling_with_shared_outputs(cells: list[Cell], cell: Cell) -> Cell | None:
    """The other cell of the same (teacher, policy) with the most complete shared stages, if any."""
    scored = [(len(_shareable(cell, c)), c) for c in _siblings(cells, cell)]
    score, best = max(scored, key=lambda sc: sc[0], default=(0, None))
    return best if score > 0 else None


def finished_record(run_dir: str) -> dict[str, Any] | None:
    """The cell's record when it finished ok (<cell>/cell.json), else None."""
    path = os.path.join(run_dir, CELL_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    return rec if rec.get("status") == "ok" else None


def stages_not_to_run(siblings: list[Cell], cell: Cell) -> list[str]:
    """The stages `cell` has complete from an earlier invocation (a cell cut in stage 2 resumes
    there) or will take from its best sibling (complete there), for its config when its fingerprints
    are known (a sibling of another run.seed offers its converted teacher only)."""
    mine = read_manifest(cell.run_dir)["stages"]
    skip = {s for s, entry in mine.items() if _applies(cell, s, entry)}
    best = sibling_with_shared_outputs(siblings, cell)
    if best is not None:
        skip |= set(_shareable(cell, best))
    return sorted(skip)


def waits_for_sibling(cells: list[Cell], cell: Cell) -> bool:
    """Another process is making outputs this cell would take and no sibling offers them yet: its
    (teacher, policy)'s selection (no sibling has anything to share), or the statistics and init of
    its init (a cell of its init in another grid): running it now would make them a second time."""
    def started(c: Cell) -> bool:
        return os.path.isfile(os.path.join(c.run_dir, "run.json"))

    def has_start(c: Cell) -> bool:
        stages = read_manifest(c.run_dir)["stages"]
        return all(_complete_here(stages.get(s, {})) for s in SAME_INIT_STAGES)

    if started(cell):
        return False
    siblings = _siblings(cells, cell)
    busy = [c for c in siblings if started(c) and finished_record(c.run_dir) is None]
    if not busy:
        return False
    if not any(_shareable(cell, c) for c in siblings):
        return True
    same_init = [c for c in siblings if c.init == cell.init]
    return any(c in busy for c in same_init) and not any(has_start(c) for c in same_init)
