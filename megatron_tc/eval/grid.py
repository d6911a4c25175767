"""Experiment grid: init strategy x retained-layer policy x teacher, one command, one results table.

Grid file (YAML)::

    base: tiny.yaml            # the run config every cell starts from (relative to this file)
    out: runs/grid             # cell run dirs: <out>/<teacher>/<policy>/<init>; tables: <out>/results.{md,json}
    mode: zero_shot            # zero_shot: init + evaluate, no training; pipeline: the config's run.stages
    process: subprocess        # subprocess (default): one `python tools/distill.py` per cell; inline: this process
    overrides: [distill.stage2.steps=20]       # key=value for every cell (optional)
    axes:
      teacher: {smollm2: /path/to/teacher}     # name -> model.teacher
      policy: [uniform, ga]                    # -> model.policy
      init: [naive, zero_gate, taylor_calibrate]   # -> calibrate.init

Each cell is `run_cell(cfg, grid, cell) -> metrics dict` on the cell's resolved run config (the base
plus overrides plus `model.teacher`, `model.policy`, `calibrate.init`, `run.run_dir`). A finished
cell writes `<cell>/cell.json` atomically; rerunning the grid skips finished cells (`force` reruns
them) and records a failing cell's error without stopping the others (unless `fail_fast`). Inside a
cell the pipeline's own bookkeeping applies: complete stages are skipped, stage 2 resumes.

Cells of one (teacher, policy) share their convert and select outputs: before a cell runs, a
finished sibling's `teacher/` and `select/` (with their manifest entries) are linked into it when
their fingerprints are the ones the cell's pipeline will require (neither stage depends on the init;
select depends on run.seed), so the teacher is converted and the layers selected once per (teacher,
policy), not once per init. A sibling of the same init (a cell of another grid over the same out
root's teachers, e.g. another stage-2 recipe) also shares `stats/` and `init/`: the calibrated start
is made once per init and seed.
Several processes may run one grid at once (one per GPU): each cell runs in the process holding its
lock (`grid_claims.py`), so they split the cells between them. SIGTERM or SIGUSR1 (`timeout`,
Slurm) stops a grid cleanly: the running cell's stage 2 checkpoints the step it is on and the cell
stays pending for the next invocation (megatron_tc.distill.signals); no other cell starts.

Runners (both go through `megatron_tc.distill.runner.run_pipeline`, the code behind tools/distill.py):
- zero_shot: run.stages = [convert, select, stats, init, eval]; metrics from the eval stage's
  `eval/results.json`: the init's zero-shot ppl, KL(teacher || student), top-1 agreement, the
  teacher's and the naive conversion's ppl, on the run's held-out evaluation windows.
- pipeline: the config's run.stages (include stage2 with distill.eval_interval for a curve, and eval
  for the final table); metrics from the run's eval_log.jsonl (zero-shot and final ppl/KL, tokens)
  and eval/results.json, and, per (teacher, policy), the tokens-to-target table across inits.
Other runners can be registered with `register_runner(mode, fn)`.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import yaml

from megatron_tc.distill.signals import ExitSignals, active, signal_name
from megatron_tc.eval.grid_claims import CellClaim
from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_ratio, fmt_tokens, md_table

GRID_KEYS = {"base", "out", "mode", "process", "overrides", "axes"}
PROCESS = ("subprocess", "inline")
AXES = ("teacher", "policy", "init")
CELL_FILE = "cell.json"
UNFINISHED = ("pending", "elsewhere")  # not run by this process (time budget / another process holds it)
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1")  # stop the grid after the running cell (megatron_tc.distill.signals)


class CellStopped(Exception):
    """A cell's pipeline stopped at a checkpoint on a signal (exit code 128 + its number); the next
    invocation resumes it."""


Runner = Callable[[Any, "Grid", "Cell"], dict[str, Any]]


class GridError(ValueError):
    """A grid file that cannot be run."""


@dataclass
class Cell:
    teacher: str
    teacher_path: str
    policy: str
    init: str
    run_dir: str
    # stage -> the fingerprint the pipeline will require (runner.config_fingerprints of the cell's
    # config), set by run_grid for the pipeline's runners: a stage output of another config (a sibling
    # with another run.seed, or a cell's own from before a config change) is then neither linked in
    # nor counted as done. None: every complete output is taken as applying.
    fingerprints: dict[str, str] | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return f"{self.teacher}/{self.policy}/{self.init}"

    def overrides(self) -> list[str]:
        return [f"model.teacher={self.teacher_path}", f"model.policy={self.policy}", f"calibrate.init={self.init}",
                f"run.run_dir={self.run_dir}"]


@dataclass
class Grid:
    base: str
    out: str
    mode: str
    axes: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    process: str = "subprocess"

    def cells(self) -> list[Cell]:
        teachers = self.axes["teacher"]
        return [Cell(t, str(teachers[t]), p, i, os.path.join(self.out, t, p, i))
                for t, p, i in itertools.product(teachers, self.axes["policy"], self.axes["init"])]


def load_grid(path: str | os.PathLike, out: str | None = None) -> Grid:
    """Parse and check a grid file; relative paths are relative to the file."""
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise GridError(f"{path}: a grid file is a mapping with keys {sorted(GRID_KEYS)}")
    unknown = sorted(set(data) - GRID_KEYS)
    if unknown:
        raise GridError(f"{path}: unknown keys {unknown}; valid keys: {sorted(GRID_KEYS)}")
    here = os.path.dirname(os.path.abspath(path))

    def rel(p: str) -> str:
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(here, p))

    axes = data.get("axes") or {}
    missing = [a for a in AXES if not axes.get(a)]
    if missing or set(axes) - set(AXES):
        raise GridError(f"{path}: axes must give non-empty {list(AXES)} (missing {missing}, "
                        f"unknown {sorted(set(axes) - set(AXES))})")
    if not isinstance(axes["teacher"], dict):
        raise GridError(f"{path}: axes.teacher maps a short name to the teacher's path, e.g. {{smollm2: DIR}}")
    for a in ("policy", "init"):
        if not isinstance(axes[a], list):
            raise GridError(f"{path}: axes.{a} must be a list, got {axes[a]!r}")
    axes["teacher"] = {str(k): rel(str(v)) for k, v in axes["teacher"].items()}
    process = data.get("process", "subprocess")
    if process not in PROCESS:
        raise GridError(f"{path}: process {process!r}; use one of {list(PROCESS)}")
    mode = data.get("mode", "zero_shot")
    if mode not in RUNNERS:
        raise GridError(f"{path}: mode {mode!r}; registered: {sorted(RUNNERS)}")
    if "base" not in data:
        raise GridError(f"{path}: 'base' (the run config of every cell) is required")
    return Grid(base=rel(data["base"]), out=rel(out or data.get("out", "runs/grid")), mode=mode, axes=axes,
                overrides=list(data.get("overrides") or []), process=process)


def cell_config(grid: Grid, cell: Cell) -> Any:
    """The cell's run config: base YAML + grid overrides + the cell's axes (validated)."""
    from megatron_tc.config.loader import load_config

    return load_config(grid.base, [*grid.overrides, *cell.overrides()])


# ---- runners ------------------------------------------------------------------------------------
ZERO_SHOT_STAGES = ("convert", "select", "stats", "init", "eval")
PIPELINE_MODES = ("zero_shot", "pipeline")  # the runners that go through the pipeline and its manifest
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DISTILL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "tools", "distill.py")


def _child_env() -> dict[str, str]:
    """This environment minus launcher variables (the child is a world of one process)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_cell_pipeline(grid: Grid, cell: Cell, extra: list[str]) -> None:
    """`run_pipeline` on the cell's config (+ extra overrides): in a child `python tools/distill.py`
    (grid `process: subprocess`, the default: every cell gets a fresh process group, DeepSpeed state
    and memory) or in this process (`process: inline`, a world of one; no import cost per cell).
    The child's output is appended to <cell>/pipeline.log under a line per invocation (a cell stopped
    and resumed keeps the log of every part); a failing child raises with the log's tail."""
    overrides = [*grid.overrides, *cell.overrides(), *extra]
    if grid.process == "inline":
        from megatron_tc.config.loader import load_config
        from megatron_tc.distill.runner import StoppedBySignal, run_pipeline

        try:
            run_pipeline(load_config(grid.base, overrides))
        except StoppedBySignal as stop:
            raise CellStopped(str(stop)) from None
        return
    log_path = os.path.join(cell.run_dir, "pipeline.log")
    with open(log_path, "ab") as log_file:
        log_file.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')}: tools/distill.py {grid.base} "
                       f"{' '.join(overrides)}\n".encode())
        log_file.flush()
        child = subprocess.Popen([sys.executable, DISTILL, grid.base, *overrides], env=_child_env(), stdout=log_file,
                                 stderr=subprocess.STDOUT)
        rc = _wait_forwarding_signal(child)
    if rc > 128:  # the child's own exit after a signal stopped it at a checkpoint (tools/distill.py)
        raise CellStopped(f"stopped by {signal_name(rc - 128)} with its state saved (log: {log_path})")
    signals = active()
    if rc < 0 and signals is not None and signals.received == -rc:  # ended outside a training loop
        raise CellStopped(f"ended by {signal_name(-rc)} between checkpoints; its unfinished stage starts over "
                          f"(log: {log_path})")
    if rc != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-2000:]
        raise RuntimeError(f"tools/distill.py exited with {rc} (log: {log_path}):\n{tail}")


def _wait_forwarding_signal(child: subprocess.Popen) -> int:
    """The child's exit code; a stop signal this process receives meanwhile is passed on to it once
    (a signal sent to the whole process group, as by `timeout` or Slurm, reaches it anyway)."""
    forwarded = False
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            signals = active()
            if signals is not None and signals.received and not forwarded:
                child.send_signal(signals.received)
                forwarded = True


def _results_rows(run_dir: str) -> dict[str, dict[str, Any]]:
    """<run>/eval/results.json (the eval stage's table) as {model label: row}."""
    path = os.path.join(run_dir, "eval", "results.json")
    if not os.path.isfile(path):
        raise GridError(f"{path} was not written: the cell's run.stages must end with 'eval'")
    with open(path, encoding="utf-8") as fh:
        return {row["model"]: row for row in json.load(fh)["rows"]}


def _zero_shot_row(rows: dict[str, dict[str, Any]], init: str) -> dict[str, Any]:
    """The eval stage names the init's row '<init> zero-shot'; naive's own row is 'naive zero-shot'."""
    return rows["naive zero-shot"] if init == "naive" else rows[f"{init} zero-shot"]


def zero_shot_runner(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """Initialize the student (no training): the pipeline's convert, select, stats, init and eval stages;
    metrics of the init's zero-shot student on the run's held-out windows (eval/results.json)."""
    run_cell_pipeline(grid, cell, [f"run.stages=[{','.join(ZERO_SHOT_STAGES)}]"])
    rows = _results_rows(cell.run_dir)
    row = _zero_shot_row(rows, cell.init)
    return {"ppl": row["ppl"], "kl": row["kl"], "top1_agree": row["top1_agree"], "teacher_ppl": rows["teacher"]["ppl"],
            "naive_ppl": rows["naive zero-shot"]["ppl"], "student": row["path"]}


def pipeline_runner(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """The config's run.stages (stage 2 with eval_interval for a curve); metrics from the run's
    eval_log.jsonl (zero-shot and last point, tokens) and, when the eval stage ran, its final table."""
    from megatron_tc.eval.tokens_to_target import load_run

    run_cell_pipeline(grid, cell, [])
    curve = load_run(cell.run_dir)
    metrics = {"zero_shot_ppl": curve.zero_shot_ppl, "ppl": curve.final_ppl, "kl": curve.kl[-1] if curve.kl else None,
               "teacher_ppl": curve.teacher_ppl, "train_tokens": curve.final_tokens}
    if os.path.isfile(os.path.join(cell.run_dir, "eval", "results.json")):
        rows = _results_rows(cell.run_dir)
        final = rows.get("after distillation")
        if final is not None:
            metrics.update(ppl=final["ppl"], kl=final["kl"], top1_agree=final["top1_agree"])
        metrics["teacher_ppl"] = rows["teacher"]["ppl"]
    return metrics


RUNNERS: dict[str, Runner] = {"zero_shot": zero_shot_runner, "pipeline": pipeline_runner}


def register_runner(mode: str, fn: Runner) -> None:
    RUNNERS[mode] = fn


def run_cell(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """One cell: the mode's runner on the resolved config -> metrics dict."""
    return RUNNERS[grid.mode](cfg, grid, cell)


# ---- outputs shared by the cells of one (teacher, policy) ---------------------------------------
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


def _manifest(run_dir: str) -> dict[str, Any]:
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
    theirs, mine = _manifest(sibling.run_dir), _manifest(cell.run_dir)
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
    stages = _manifest(sibling.run_dir)["stages"]
    return [s for s in shared_stages(cell, sibling) if _applies(cell, s, stages.get(s, {}))]


def _siblings(cells: list[Cell], cell: Cell) -> list[Cell]:
    return [c for c in cells if (c.teacher, c.policy) == (cell.teacher, cell.policy) and c is not cell]


def sibling_with_shared_outputs(cells: list[Cell], cell: Cell) -> Cell | None:
    """The other cell of the same (teacher, policy) with the most complete shared stages, if any."""
    scored = [(len(_shareable(cell, c)), c) for c in _siblings(cells, cell)]
    score, best = max(scored, key=lambda sc: sc[0], default=(0, None))
    return best if score > 0 else None


def _finished(run_dir: str) -> dict[str, Any] | None:
    """The cell's record when it finished ok (<cell>/cell.json), else None."""
    path = os.path.join(run_dir, CELL_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    return rec if rec.get("status") == "ok" else None


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
    grid's own, then committed results of earlier sessions): each tier looks in all of them. `skip`:
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
    stages = _manifest(run_dir)["stages"]
    spent = sum(float(stages[s].get("seconds") or 0.0) for s in skip
                if s in stages and "reused_from" not in stages[s])
    return max(seconds - spent, 0.0)


def _longest_recent(roots: list[str], recent: int, skip: Sequence[str] = (), kernels_cached: bool = False) -> float:
    finished = []  # (finishing time, seconds, started with an empty kernel cache)
    for top in roots:
        for root, _dirs, files in os.walk(top):
            rec = _finished(root) if CELL_FILE in files else None
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
    H200 took 397-411 s against 151-181 s for the same cell once they were cached (docs/BENCHMARKS.md,
    lessons 21 and 23), and a time check judging by that cell leaves warm cells that fit pending."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def stages_not_to_run(siblings: list[Cell], cell: Cell) -> list[str]:
    """The stages `cell` has complete from an earlier invocation (a cell cut in stage 2 resumes
    there) or will take from its best sibling (complete there), for its config when its fingerprints
    are known (a sibling of another run.seed offers its converted teacher only)."""
    mine = _manifest(cell.run_dir)["stages"]
    skip = {s for s, entry in mine.items() if _applies(cell, s, entry)}
    best = sibling_with_shared_outputs(siblings, cell)
    if best is not None:
        skip |= set(_shareable(cell, best))
    return sorted(skip)


# ---- the grid ---------------------------------------------------------------------------------
def _waits_for_sibling(cells: list[Cell], cell: Cell) -> bool:
    """Another process is making outputs this cell would take and no sibling offers them yet: its
    (teacher, policy)'s selection (no sibling has anything to share), or the statistics and init of
    its init (a cell of its init in another grid): running it now would make them a second time."""
    def started(c: Cell) -> bool:
        return os.path.isfile(os.path.join(c.run_dir, "run.json"))

    def has_start(c: Cell) -> bool:
        stages = _manifest(c.run_dir)["stages"]
        return all(_complete_here(stages.get(s, {})) for s in SAME_INIT_STAGES)

    if started(cell):
        return False
    siblings = _siblings(cells, cell)
    busy = [c for c in siblings if started(c) and _finished(c.run_dir) is None]
    if not busy:
        return False
    if not any(_shareable(cell, c) for c in siblings):
        return True
    same_init = [c for c in siblings if c.init == cell.init]
    return any(c in busy for c in same_init) and not any(has_start(c) for c in same_init)


def run_grid(grid: Grid, force: bool = False, fail_fast: bool = False,
             log: Callable[[str], None] = print, max_seconds: float | None = None,
             history: Sequence[str] = (), donors: Sequence[Cell] = ()) -> list[dict[str, Any]]:
    """Run every cell (skipping finished ones), then write <out>/results.json and results.md.
    `max_seconds`: start no cell that would likely end after this many seconds, judged by the
    longest cell of its teacher and init in this invocation, or before one has finished by the recently
    finished cells of earlier ones (`recent_cell_seconds`), less what those spent on the stages this
    cell has or takes from a sibling (`stages_not_to_run`); those are recorded as 'pending' and run
    by the next invocation; `history`: more dirs laid out like the grid's out (committed results of
    earlier sessions) that count as earlier invocations there. Several processes may run one grid at
    once (grid_claims): a cell another process holds is recorded 'elsewhere', and a cell whose
    sibling another process is setting up waits until the other cells have been tried. `donors`:
    cells of other grids (e.g. another stage-2 recipe) whose shared outputs a cell may take when it
    starts, as its own grid's siblings' (`reuse_sibling_stages`)."""
    cells = grid.cells()
    siblings = [*cells, *donors]  # the cells whose shared outputs a cell may take
    configs = {c.key: cell_config(grid, c) for c in cells}  # every config is checked before any work
    if grid.mode in PIPELINE_MODES:
        from megatron_tc.distill.runner import config_fingerprints

        for c in cells:
            c.fingerprints = config_fingerprints(configs[c.key])
    records: dict[int, dict[str, Any]] = {}
    started, ran_here = time.perf_counter(), {}  # (teacher, init) -> [(run dir, seconds, cold start)] here
    queue, deferred = deque(enumerate(cells, 1)), set()
    with ExitSignals(EXIT_SIGNALS) as signals:  # after a stop signal: the running cell stops, no new one starts
        while queue:
            n, cell = queue.popleft()
            done = None if force else _finished(cell.run_dir)
            if done is not None:
                log(f"[{n}/{len(cells)}] {cell.key}: done before, skipped")
                records[n] = done
                continue
            if signals.received:
                log(f"[{n}/{len(cells)}] {cell.key}: pending ({signal_name(signals.received)} received)")
                records[n] = _placeholder(cell, "pending")
                continue
            if max_seconds is not None and time.perf_counter() - started + _expected_seconds(
                    cell, siblings, ran_here, [grid.out, *history]) > max_seconds:
                log(f"[{n}/{len(cells)}] {cell.key}: pending (time budget of {max_seconds:.0f} s)")
                records[n] = _placeholder(cell, "pending")
                continue
            if n not in deferred and queue and _waits_for_sibling(siblings, cell):
                log(f"[{n}/{len(cells)}] {cell.key}: a sibling is being set up elsewhere; later")
                deferred.add(n)
                queue.append((n, cell))
                continue
            with CellClaim(cell.run_dir) as held:
                if not held:
                    log(f"[{n}/{len(cells)}] {cell.key}: running in another process, skipped")
                    records[n] = _placeholder(cell, "elsewhere")
                    continue
                done = None if force else _finished(cell.run_dir)  # another process may have just finished it
                records[n] = done or _run_one(grid, siblings, cell, configs[cell.key], f"[{n}/{len(cells)}]", log,
                                              fail_fast)
            if done is None and records[n]["status"] != "pending":  # a stopped cell's time is not a cell's
                ran_here.setdefault((cell.teacher, cell.init), []).append(
                    (cell.run_dir, records[n]["seconds"], records[n].get("kernels_cached") is False))
    ordered = [records[n] if records[n]["status"] != "elsewhere" else _finished(records[n]["run_dir"]) or records[n]
               for n in sorted(records)]  # cells other processes finished meanwhile count as finished
    write_results(grid, ordered)
    return ordered


def _expected_seconds(cell: Cell, siblings: list[Cell], ran_here: dict, roots: list[str]) -> float:
    """How long `cell` will likely take: the longest cell of its teacher and init in this invocation
    (`ran_here`), else the recent ones under `roots`, less the stages it will not run; once the kernels
    are cached here, not counting cells that compiled them (when others are known)."""
    skip, cached = stages_not_to_run(siblings, cell), kernels_cached_here()
    here = [(cell_seconds_without(d, sec, skip), cold) for d, sec, cold in ran_here.get((cell.teacher, cell.init), [])]
    return (max((sec for sec, _ in _without_cold_starts(here, cached)), default=0.0)
            or recent_cell_seconds(roots, teacher=cell.teacher, init=cell.init, skip=skip, kernels_cached=cached))


def _placeholder(cell: Cell, status: str) -> dict[str, Any]:
    return {"teacher": cell.teacher, "policy": cell.policy, "init": cell.init, "run_dir": cell.run_dir,
            "status": status, "seconds": 0.0}


def _run_one(grid: Grid, siblings: list[Cell], cell: Cell, cfg: Any, tag: str, log: Callable[[str], None],
             fail_fast: bool) -> dict[str, Any]:
    """Run one claimed cell: link a finished sibling's shared outputs in, run it, write cell.json."""
    os.makedirs(cell.run_dir, exist_ok=True)
    atomic_write_text(os.path.join(cell.run_dir, "run.json"), json.dumps(
        {"name": cell.init, "init": cell.init, "policy": cell.policy, "teacher": cell.teacher}) + "\n")
    log(f"{tag} {cell.key}: running ({grid.mode})")
    sibling = sibling_with_shared_outputs(siblings, cell)
    reused = reuse_sibling_stages(cell, sibling) if sibling is not None else []
    if reused:
        log(f"    {', '.join(reused)}: outputs of {sibling.key} linked in (the pipeline checks they apply)")
    start = time.perf_counter()
    rec = {"teacher": cell.teacher, "policy": cell.policy, "init": cell.init, "run_dir": cell.run_dir,
           "kernels_cached": kernels_cached_here()}
    try:
        rec.update(status="ok", metrics=run_cell(cfg, grid, cell))
    except CellStopped as stop:  # no cell.json: the next invocation runs (resumes) it
        log(f"    {stop}; pending")
        return {**rec, "status": "pending", "seconds": round(time.perf_counter() - start, 2)}
    except Exception as exc:  # a failed cell is recorded; the grid goes on unless fail_fast
        if fail_fast:
            raise
        rec.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        log(f"    failed: {rec['error']}")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    atomic_write_text(os.path.join(cell.run_dir, CELL_FILE), json.dumps(rec, indent=1, default=str) + "\n")
    return rec


def _ratio_vs_naive(records: list[dict[str, Any]], rec: dict[str, Any]) -> str:
    base = next((r for r in records if r["teacher"] == rec["teacher"] and r["policy"] == rec["policy"]
                 and r["init"] == "naive" and r["status"] == "ok"), None)
    if base is None or rec["status"] != "ok" or not rec["metrics"].get("ppl"):
        return "—"
    return f"{base['metrics']['ppl'] / rec['metrics']['ppl']:.2f}x"


def _tokens_to_target_table(res: dict[str, Any]) -> str:
    labels = [t["label"] for t in res["targets"]]
    rows = [[r["name"]] + [fmt_tokens(r["tokens"][lab]) for lab in labels] for r in res["runs"]]
    for base, table in res["ratios"].items():
        rows += [[f"{name}: x fewer tokens than {base.removeprefix('vs_')}"] + [fmt_ratio(cells[lab]) for lab in labels]
                 for name, cells in table.items()]
    return md_table(["run"] + labels, rows)


def _tokens_to_target_sections(grid: Grid, records: list[dict[str, Any]]) -> list[str]:
    """pipeline mode: tokens-to-target across inits for each (teacher, policy), first reach and
    reached-and-stayed (a calibrated start can rise above a target in its first steps)."""
    from megatron_tc.eval.tokens_to_target import EvalLogError, load_run, tokens_to_target

    out = []
    groups = sorted({(r["teacher"], r["policy"]) for r in records})
    for teacher, policy in groups:
        dirs = [r["run_dir"] for r in records if (r["teacher"], r["policy"]) == (teacher, policy) and r["status"] == "ok"]
        try:
            curves = [load_run(d) for d in dirs]
            first, stayed = (tokens_to_target(curves, stay=stay) for stay in (False, True))
        except EvalLogError as exc:
            out.append(f"### {teacher} / {policy}\n\ntokens-to-target not available: {exc}")
            continue
        out.append(f"### {teacher} / {policy}\n\nFirst reach:\n\n{_tokens_to_target_table(first)}\n\n"
                   f"Reached and stayed at or below the target for the rest of the run:\n\n"
                   f"{_tokens_to_target_table(stayed)}")
    return out


def _shown_path(path: str) -> str:
    """Relative to the working directory when below it, so a results.md can be copied into docs."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def relative_ppl(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{teacher: {policy: {init: ppl / teacher_ppl}}} over the finished cells that report both."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        m = r.get("metrics") or {}
        if r["status"] == "ok" and m.get("ppl") and m.get("teacher_ppl"):
            out.setdefault(r["teacher"], {}).setdefault(r["policy"], {})[r["init"]] = m["ppl"] / m["teacher_ppl"]
    return out


def write_results(grid: Grid, records: list[dict[str, Any]]) -> tuple[str, str]:
    """<out>/results.json (every record), <out>/results.md (tables) and <out>/results.png (the plot)."""
    os.makedirs(grid.out, exist_ok=True)
    json_path, md_path = os.path.join(grid.out, "results.json"), os.path.join(grid.out, "results.md")
    atomic_write_text(json_path, json.dumps({"mode": grid.mode, "base": grid.base, "cells": records},
                                            indent=1, default=str) + "\n")
    trained = grid.mode != "zero_shot"  # pipeline-like modes train, so they have eval logs
    keys = ["ppl", "kl", "top1_agree", "teacher_ppl"] + (["zero_shot_ppl", "train_tokens"] if trained else [])
    rows = [[r["teacher"], r["policy"], r["init"], r["status"]]
            + [fmt_num((r.get("metrics") or {}).get(k)) for k in keys] + [_ratio_vs_naive(records, r), r["seconds"]]
            for r in records]
    parts = [f"# Grid results ({grid.mode})",
             f"Base config: `{_shown_path(grid.base)}`; cells under `{_shown_path(grid.out)}`.",
             md_table(["teacher", "policy", "init", "status", *keys, "naive ppl / ppl", "seconds"], rows)]
    for teacher in grid.axes["teacher"]:
        pivot = [[init] + [fmt_num(next(((r.get("metrics") or {}).get("ppl") for r in records
                                         if (r["teacher"], r["policy"], r["init"]) == (teacher, p, init)), None))
                           for p in grid.axes["policy"]] for init in grid.axes["init"]]
        parts.append(f"## {teacher}: perplexity (rows: init, columns: policy)\n\n"
                     + md_table(["init", *grid.axes["policy"]], pivot))
    panels = relative_ppl(records)
    if panels:
        from megatron_tc.eval.plots import plot_grouped_bars

        what = "after stage 2" if trained else "zero-shot"
        plot_grouped_bars(panels, os.path.join(grid.out, "results.png"), ylabel="perplexity / teacher's",
                          title=f"Eval perplexity {what}, relative to the teacher (black line)")
        parts.append(f"![perplexity {what} / teacher, per cell](results.png)")
    if trained:
        parts.append("## Tokens to target\n\n" + "\n\n".join(_tokens_to_target_sections(grid, records)))
    pending = [r for r in records if r["status"] in UNFINISHED]
    if pending:
        parts.append("## Pending cells (not run yet, or still running in another process: rerun the grid)\n\n"
                     + "\n".join(f"- {r['teacher']}/{r['policy']}/{r['init']}"
                                  + (" (running elsewhere)" if r["status"] == "elsewhere" else "") for r in pending))
    failed = [r for r in records if r["status"] not in ("ok", *UNFINISHED)]
    if failed:
        parts.append("## Failed cells\n\n" + "\n".join(f"- {r['teacher']}/{r['policy']}/{r['init']}: {r['error']}"
                                                        for r in failed))
    atomic_write_text(md_path, "\n\n".join(parts) + "\n")
    return json_path, md_path


def grid_main(argv: list[str] | None = None) -> int:
    import argparse

    import megatron_tc.calibrate.strategies  # noqa: F401  (registers every init, ablations included, before cells are checked)

    p = argparse.ArgumentParser(prog="run_grid.py", description="Run an init x policy x teacher grid from a grid file")
    p.add_argument("grid", help="grid YAML (see megatron_tc/eval/grid.py)")
    p.add_argument("--out", help="override the grid's out directory")
    p.add_argument("--force", action="store_true", help="rerun cells that finished before")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    p.add_argument("--list", action="store_true", help="print the cells and exit")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no cell likely to end after this many seconds; the rest stay pending for the next run")
    args = p.parse_args(argv)
    grid = load_grid(args.grid, out=args.out)
    if args.list:
        for c in grid.cells():
            print(c.key, " ".join(c.overrides()))
        return 0
    records = run_grid(grid, force=args.force, fail_fast=args.fail_fast, max_seconds=args.max_seconds)
    from megatron_tc.parallel.state import shutdown_distributed

    shutdown_distributed()  # inline cells leave this process's group open
    print(os.path.join(grid.out, "results.md"))
    if any(r["status"] == "failed" for r in records):
        return 1
    return 3 if any(r["status"] in UNFINISHED for r in records) else 0
