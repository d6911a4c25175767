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
is made once per init and seed (grid_reuse.py). With a time budget, a cell starts only when it is
likely to end within it (grid_timing.py); the tables are written by grid_results.py.
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

import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import yaml

from megatron_tc.config.errors import InputError, command_line
from megatron_tc.config.paths import PKG_PREFIX
from megatron_tc.distill.signals import ExitSignals, active, signal_name
from megatron_tc.eval.grid_claims import CellClaim
from megatron_tc.eval.grid_results import UNFINISHED, write_results
from megatron_tc.eval.grid_reuse import (CELL_FILE, finished_record, reuse_sibling_stages, sibling_with_shared_outputs,
                                         waits_for_sibling)
from megatron_tc.eval.grid_timing import expected_seconds, kernels_cached_here
from megatron_tc.eval.report import atomic_write_text

GRID_KEYS = {"base", "out", "mode", "process", "overrides", "axes"}
PROCESS = ("subprocess", "inline")
AXES = ("teacher", "policy", "init")
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
    if not os.path.isfile(path):
        raise GridError(f"{path}: no such grid file (its format: the docstring of megatron_tc/eval/grid.py)")
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise GridError(f"{path}: a grid file is a mapping with keys {sorted(GRID_KEYS)}")
    unknown = sorted(set(data) - GRID_KEYS)
    if unknown:
        raise GridError(f"{path}: unknown keys {unknown}; valid keys: {sorted(GRID_KEYS)}")
    here = os.path.dirname(os.path.abspath(path))

    def rel(p: str) -> str:  # a `pkg:` teacher names a file inside an installed package, not a path
        return p if os.path.isabs(p) or p.startswith(PKG_PREFIX) else os.path.normpath(os.path.join(here, p))

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
            return child.wait(timeout=0.1)  # a stop signal reaches the cell within 0.1 s
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
        results = json.load(fh)
    rows = {row["model"]: row for row in results["rows"]}
    for row in rows.values():  # the windows' BOS convention (megatron_tc.data.bos), None before it was recorded
        row.setdefault("bos", results.get("bos"))
    return rows


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
            "naive_ppl": rows["naive zero-shot"]["ppl"], "student": row["path"], "bos": row["bos"]}


def pipeline_runner(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """The config's run.stages (stage 2 with eval_interval for a curve); metrics from the run's
    eval_log.jsonl (zero-shot and last point, tokens) and, when the eval stage ran, its final table."""
    from megatron_tc.eval.tokens_to_target import load_run

    run_cell_pipeline(grid, cell, [])
    curve = load_run(cell.run_dir)
    metrics = {"zero_shot_ppl": curve.zero_shot_ppl, "ppl": curve.final_ppl, "kl": curve.kl[-1] if curve.kl else None,
               "teacher_ppl": curve.teacher_ppl, "train_tokens": curve.final_tokens, "bos": curve.meta.get("bos")}
    if os.path.isfile(os.path.join(cell.run_dir, "eval", "results.json")):
        rows = _results_rows(cell.run_dir)
        final = rows.get("after distillation")
        if final is not None:
            metrics.update(ppl=final["ppl"], kl=final["kl"], top1_agree=final["top1_agree"])
        metrics.update(teacher_ppl=rows["teacher"]["ppl"], bos=rows["teacher"]["bos"])
    return metrics


RUNNERS: dict[str, Runner] = {"zero_shot": zero_shot_runner, "pipeline": pipeline_runner}


def register_runner(mode: str, fn: Runner) -> None:
    RUNNERS[mode] = fn


def run_cell(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """One cell: the mode's runner on the resolved config -> metrics dict."""
    return RUNNERS[grid.mode](cfg, grid, cell)


# ---- the grid ---------------------------------------------------------------------------------
def run_grid(grid: Grid, force: bool = False, fail_fast: bool = False,
             log: Callable[[str], None] = print, max_seconds: float | None = None,
             history: Sequence[str] = (), donors: Sequence[Cell] = ()) -> list[dict[str, Any]]:
    """Run every cell (skipping finished ones), then write <out>/results.json and results.md.
    `max_seconds`: start no cell that would likely end after this many seconds, judged by the
    longest cell of its teacher and init in this invocation, or before one has finished by the recently
    finished cells of earlier ones (`recent_cell_seconds`), less what those spent on the stages this
    cell has or takes from a sibling (`stages_not_to_run`); those are recorded as 'pending' and run
    by the next invocation; `history`: more dirs laid out like the grid's out (e.g. results copied from
    another machine) that count as earlier invocations there. Several processes may run one grid at
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
            done = None if force else finished_record(cell.run_dir)
            if done is not None:
                log(f"[{n}/{len(cells)}] {cell.key}: done before, skipped")
                records[n] = done
                continue
            if signals.received:
                log(f"[{n}/{len(cells)}] {cell.key}: pending ({signal_name(signals.received)} received)")
                records[n] = _placeholder(cell, "pending")
                continue
            if max_seconds is not None and time.perf_counter() - started + expected_seconds(
                    cell, siblings, ran_here, [grid.out, *history]) > max_seconds:
                log(f"[{n}/{len(cells)}] {cell.key}: pending (time budget of {max_seconds:.0f} s)")
                records[n] = _placeholder(cell, "pending")
                continue
            if n not in deferred and queue and waits_for_sibling(siblings, cell):
                log(f"[{n}/{len(cells)}] {cell.key}: a sibling is being set up elsewhere; later")
                deferred.add(n)
                queue.append((n, cell))
                continue
            with CellClaim(cell.run_dir) as held:
                if not held:
                    log(f"[{n}/{len(cells)}] {cell.key}: running in another process, skipped")
                    records[n] = _placeholder(cell, "elsewhere")
                    continue
                done = None if force else finished_record(cell.run_dir)  # another process may have just finished it
                records[n] = done or _run_one(grid, siblings, cell, configs[cell.key], f"[{n}/{len(cells)}]", log,
                                              fail_fast)
            if done is None and records[n]["status"] != "pending":  # a stopped cell's time is not a cell's
                ran_here.setdefault((cell.teacher, cell.init), []).append(
                    (cell.run_dir, records[n]["seconds"], records[n].get("kernels_cached") is False))
    ordered = [records[n] if records[n]["status"] != "elsewhere" else finished_record(records[n]["run_dir"]) or records[n]
               for n in sorted(records)]  # cells other processes finished meanwhile count as finished
    write_results(grid, ordered)
    return ordered


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


@command_line
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
    try:
        grid = load_grid(args.grid, out=args.out)
    except GridError as err:
        raise InputError(f"error: {err}") from None
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
