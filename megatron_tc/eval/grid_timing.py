"""How long a grid cell will likely take: the time check behind `run_grid(max_seconds=...)`.

A cell is judged by cells that finished before it (in this invocation, else recently under the
grid's out dir and the result roots the user names with --history), less the stages it will not
run itself, and, once this machine has compiled the kernels, not by the cells that paid for
compiling them (a cold fla compile adds minutes to a cell).
"""
from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Sequence

from megatron_tc.eval.grid_reuse import CELL_FILE, finished_record, read_manifest, stages_not_to_run

if TYPE_CHECKING:
    from megatron_tc.eval.grid import Cell


def recent_cell_seconds(out: str | Sequence[str], recent: int = 3, teacher: str | None = None,
                        init: str | None = None, skip: Sequence[str] = (), kernels_cached: bool = False) -> float:
    """The longest of the `recent` most recently finished cells under a grid's out dir (0 when
    none): what a fresh invocation expects its next cell to take. Recent ones, because the cost of
    a cell changes with the code (and unpacked results keep their finishing times). With `teacher`,
    that teacher's cells (<out>/<teacher>/...) when it has any: a cell of a 30-layer teacher takes
    several times one of a 12-layer teacher, so the other teachers' cells are only the fallback.
    With `init` too, that teacher's cells of the same init (<out>/<teacher>/*/<init>) come first: a
    calibrated init aligns every converted layer before stage 2, which a naive cell does not (on the
    H200, 90-165 s of a 300-370 s SmolLM2 cell). `out` may be several dirs of the same layout (the
    grid's own, then earlier result roots named by the user): each tier looks in all of them. `skip`:
    stages the coming cell takes from a sibling, whose seconds a cell that ran them itself does not
    count (`cell_seconds_without`). `kernels_cached`: this machine has compiled the kernels already, so
    cells that started with an empty kernel cache (`kernels_cached_here`) count only when a tier has no
    other (they paid the compilation a coming cell will not)."""
    outs = [out] if isinstance(out, str) else list(out)
    tiers = [outs]  # most specific first
    if teacher is not None:
        tiers.insert(0, [os.path.join(o, teacher) for o in outs])
        if init is not None:
            tiers.insert(0, [d for o in outs
                             for d in glob.glob(os.path.join(glob.escape(o), glob.escape(teacher), "*", glob.escape(init)))])
    for roots in tiers:
        seconds = _longest_recent(roots, recent, skip, kernels_cached)
        if seconds > 0:
            return seconds
    return 0.0


def cell_seconds_without(run_dir: str, seconds: float, skip: Sequence[str]) -> float:
    """A cell's `seconds` less those its own runs of the `skip` stages took (by its manifest; a stage
    it took from a sibling cost it nothing): how long a cell that takes those stages from a sibling
    can expect to run, judged by this one. A statistics pass and an alignment are 130-270 s of a
    300-430 s SmolLM2 cell on the H200."""
    stages = read_manifest(run_dir)["stages"]
    spent = sum(float(stages[s].get("seconds") or 0.0) for s in skip
                if s in stages and "reused_from" not in stages[s])
    return max(seconds - spent, 0.0)


def _longest_recent(roots: list[str], recent: int, skip: Sequence[str] = (), kernels_cached: bool = False) -> float:
    finished = []  # (finishing time, seconds, started with an empty kernel cache)
    for top in roots:
        for root, _dirs, files in os.walk(top):
            rec = finished_record(root) if CELL_FILE in files else None
            if rec is not None:
                finished.append((os.path.getmtime(os.path.join(root, CELL_FILE)),
                                 cell_seconds_without(root, float(rec.get("seconds") or 0.0), skip),
                                 rec.get("kernels_cached") is False))
    finished = _without_cold_starts(finished, kernels_cached)
    return max((seconds for _, seconds, _ in sorted(finished, reverse=True)[:recent]), default=0.0)


def _without_cold_starts(finished: list[tuple], kernels_cached: bool) -> list[tuple]:
    """`finished` (tuples whose last item says the cell started with an empty kernel cache) less the
    cold starts, when the kernels are cached here now and some cell was not a cold start."""
    warm = [f for f in finished if not f[-1]]
    return warm if kernels_cached and warm else finished


def kernels_cached_here() -> bool:
    """Whether this machine's Triton cache (TRITON_CACHE_DIR, else Triton's default) holds anything.
    A cell started without it compiles the fla kernels as it goes: the first SmolLM2 cell of a fresh
    H200 took 397-411 s against 151-181 s for the same cell once they were cached, and a time check judging by that cell leaves warm cells that fit pending."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def expected_seconds(cell: Cell, siblings: list[Cell], ran_here: dict, roots: list[str]) -> float:
    """How long `cell` will likely take: the longest cell of its teacher and init in this invocation
    (`ran_here`), else the recent ones under `roots`, less the stages it will not run; once the kernels
    are cached here, not counting cells that compiled them (when others are known)."""
    skip, cached = stages_not_to_run(siblings, cell), kernels_cached_here()
    here = [(cell_seconds_without(d, sec, skip), cold) for d, sec, cold in ran_here.get((cell.teacher, cell.init), [])]
    return (max((sec for sec, _ in _without_cold_starts(here, cached)), default=0.0)
            or recent_cell_seconds(roots, teacher=cell.teacher, init=cell.init, skip=skip, kernels_cached=cached))
