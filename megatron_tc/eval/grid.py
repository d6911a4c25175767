"""Experiment grid: init strategy x retained-layer policy x teacher, one command, one results table.

Grid file (YAML)::

    base: tiny.yaml            # the run config every cell starts from (relative to this file)
    out: runs/grid             # cell run dirs: <out>/<teacher>/<policy>/<init>; tables: <out>/results.{md,json}
    mode: zero_shot            # zero_shot: calibrate + evaluate; pipeline: the config's stages (stage 2 ...)
    overrides: [distill.stage2.steps=20]       # key=value for every cell (optional)
    axes:
      teacher: {smollm2: /path/to/teacher}     # name -> model.teacher
      policy: [uniform, ga]                    # -> model.policy
      init: [naive, zero_gate, taylor_calibrate]   # -> calibrate.init
    eval: {text: heldout.txt, seq_len: 512, max_tokens: 8192, batch_size: 1}  # zero_shot cells

Each cell is `run_cell(cfg, grid) -> metrics dict` on the cell's resolved run config (the base plus
overrides plus `model.teacher`, `model.policy`, `calibrate.init`, `run.run_dir`). A finished cell
writes `<cell>/cell.json` atomically; rerunning the grid skips finished cells (`force` reruns them)
and records a failing cell's error without stopping the others (unless `fail_fast`).

Runners (the function boundary to the rest of the pipeline):
- zero_shot: `megatron_tc.calibrate.api.calibrate_from_config(cfg) -> student checkpoint path`
  (the function behind tools/calibrate.py), then `perplexity.evaluate_text` of the student against
  the teacher on `eval.text`: ppl, kl, top1_agree, teacher_ppl.
- pipeline: `megatron_tc.pipeline.run_pipeline(cfg)` (what launch/distill.sh runs), then the metrics
  of the run's eval_log.jsonl (zero-shot and final ppl/KL, tokens) and, per (teacher, policy), the
  tokens-to-target table across inits.
Other runners can be registered with `register_runner(mode, fn)`.
"""
from __future__ import annotations

import importlib
import itertools
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_ratio, fmt_tokens, md_table

GRID_KEYS = {"base", "out", "mode", "overrides", "axes", "eval"}
AXES = ("teacher", "policy", "init")
EVAL_KEYS = {"text", "seq_len", "max_tokens", "batch_size", "device", "dtype"}
CELL_FILE = "cell.json"
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
    eval: dict[str, Any] = field(default_factory=dict)

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
    ev = dict(data.get("eval") or {})
    if set(ev) - EVAL_KEYS:
        raise GridError(f"{path}: unknown eval keys {sorted(set(ev) - EVAL_KEYS)}; valid: {sorted(EVAL_KEYS)}")
    if "text" in ev:
        ev["text"] = rel(ev["text"])
    mode = data.get("mode", "zero_shot")
    if mode not in RUNNERS:
        raise GridError(f"{path}: mode {mode!r}; registered: {sorted(RUNNERS)}")
    if "base" not in data:
        raise GridError(f"{path}: 'base' (the run config of every cell) is required")
    return Grid(base=rel(data["base"]), out=rel(out or data.get("out", "runs/grid")), mode=mode, axes=axes,
                overrides=list(data.get("overrides") or []), eval=ev)


def cell_config(grid: Grid, cell: Cell) -> Any:
    """The cell's run config: base YAML + grid overrides + the cell's axes (validated)."""
    from megatron_tc.config.loader import load_config

    return load_config(grid.base, [*grid.overrides, *cell.overrides()])


# ---- runners ------------------------------------------------------------------------------------
def _function(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ImportError:
        fn = None
    if fn is None:
        raise GridError(f"{spec} is not available in this checkout; the grid's runner calls it")
    return fn


def zero_shot_runner(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """Initialize the student (no training) and score it against the teacher on grid.eval.text."""
    from megatron_tc.eval.loading import load_model
    from megatron_tc.eval.perplexity import evaluate_text

    if "text" not in grid.eval:
        raise GridError("zero_shot mode needs eval.text (a held-out text file) in the grid file")
    student_path = _function("megatron_tc.calibrate.api:calibrate_from_config")(cfg)
    dev, dtype = grid.eval.get("device", "cpu"), grid.eval.get("dtype", "float32")
    student, teacher = load_model(student_path, dev, dtype), load_model(cell.teacher_path, dev, dtype)
    tok = student.tokenizer or teacher.tokenizer
    res = evaluate_text(student, grid.eval["text"], tok, int(grid.eval.get("seq_len", 512)),
                        int(grid.eval.get("max_tokens", 8192)), teacher=teacher,
                        batch_size=int(grid.eval.get("batch_size", 1)), device=dev, progress=False)
    atomic_write_text(os.path.join(cell.run_dir, "eval.json"), json.dumps(res.to_dict(), indent=1) + "\n")
    return {**res.to_dict(), "student": str(student_path)}


def pipeline_runner(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """Run the configured pipeline stages, then read the run's eval log."""
    from megatron_tc.eval.tokens_to_target import load_run

    _function("megatron_tc.pipeline:run_pipeline")(cfg)
    curve = load_run(cell.run_dir)
    return {"zero_shot_ppl": curve.zero_shot_ppl, "ppl": curve.final_ppl, "kl": curve.kl[-1] if curve.kl else None,
            "teacher_ppl": curve.teacher_ppl, "train_tokens": curve.final_tokens}


RUNNERS: dict[str, Runner] = {"zero_shot": zero_shot_runner, "pipeline": pipeline_runner}


def register_runner(mode: str, fn: Runner) -> None:
    RUNNERS[mode] = fn


def run_cell(cfg: Any, grid: Grid, cell: Cell) -> dict[str, Any]:
    """One cell: the mode's runner on the resolved config -> metrics dict."""
    return RUNNERS[grid.mode](cfg, grid, cell)


# ---- the grid ---------------------------------------------------------------------------------
def run_grid(grid: Grid, force: bool = False, fail_fast: bool = False,
             log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every cell (skipping finished ones), then write <out>/results.json and results.md."""
    cells = grid.cells()
    configs = {c.key: cell_config(grid, c) for c in cells}  # every config is checked before any work
    records = []
    for n, cell in enumerate(cells, 1):
        path = os.path.join(cell.run_dir, CELL_FILE)
        if os.path.isfile(path) and not force:
            with open(path, encoding="utf-8") as fh:
                rec = json.load(fh)
            if rec.get("status") == "ok":
                log(f"[{n}/{len(cells)}] {cell.key}: done before, skipped")
                records.append(rec)
                continue
        os.makedirs(cell.run_dir, exist_ok=True)
        atomic_write_text(os.path.join(cell.run_dir, "run.json"), json.dumps(
            {"name": cell.init, "init": cell.init, "policy": cell.policy, "teacher": cell.teacher}) + "\n")
        log(f"[{n}/{len(cells)}] {cell.key}: running ({grid.mode})")
        start = time.perf_counter()
        rec = {"teacher": cell.teacher, "policy": cell.policy, "init": cell.init, "run_dir": cell.run_dir}
        try:
            rec.update(status="ok", metrics=run_cell(configs[cell.key], grid, cell))
        except Exception as exc:  # a failed cell is recorded; the grid goes on unless fail_fast
            if fail_fast:
                raise
            rec.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            log(f"    failed: {rec['error']}")
        rec["seconds"] = round(time.perf_counter() - start, 2)
        atomic_write_text(path, json.dumps(rec, indent=1, default=str) + "\n")
        records.append(rec)
    write_results(grid, records)
    return records


def _ratio_vs_naive(records: list[dict[str, Any]], rec: dict[str, Any]) -> str:
    base = next((r for r in records if r["teacher"] == rec["teacher"] and r["policy"] == rec["policy"]
                 and r["init"] == "naive" and r["status"] == "ok"), None)
    if base is None or rec["status"] != "ok" or not rec["metrics"].get("ppl"):
        return "—"
    return f"{base['metrics']['ppl'] / rec['metrics']['ppl']:.2f}x"


def _tokens_to_target_sections(grid: Grid, records: list[dict[str, Any]]) -> list[str]:
    """pipeline mode: tokens-to-target across inits for each (teacher, policy)."""
    from megatron_tc.eval.tokens_to_target import EvalLogError, load_run, tokens_to_target

    out = []
    groups = sorted({(r["teacher"], r["policy"]) for r in records})
    for teacher, policy in groups:
        dirs = [r["run_dir"] for r in records if (r["teacher"], r["policy"]) == (teacher, policy) and r["status"] == "ok"]
        try:
            res = tokens_to_target([load_run(d) for d in dirs])
        except EvalLogError as exc:
            out.append(f"### {teacher} / {policy}\n\ntokens-to-target not available: {exc}")
            continue
        labels = [t["label"] for t in res["targets"]]
        rows = [[r["name"]] + [fmt_tokens(r["tokens"][lab]) for lab in labels] for r in res["runs"]]
        for base, table in res["ratios"].items():
            rows += [[f"{name}: x fewer tokens than {base.removeprefix('vs_')}"] + [fmt_ratio(cells[lab]) for lab in labels]
                     for name, cells in table.items()]
        out.append(f"### {teacher} / {policy}\n\n" + md_table(["run"] + labels, rows))
    return out


def write_results(grid: Grid, records: list[dict[str, Any]]) -> tuple[str, str]:
    """<out>/results.json (every record) and <out>/results.md (tables)."""
    os.makedirs(grid.out, exist_ok=True)
    json_path, md_path = os.path.join(grid.out, "results.json"), os.path.join(grid.out, "results.md")
    atomic_write_text(json_path, json.dumps({"mode": grid.mode, "base": grid.base, "cells": records},
                                            indent=1, default=str) + "\n")
    trained = grid.mode != "zero_shot"  # pipeline-like modes train, so they have eval logs
    keys = ["ppl", "kl", "top1_agree", "teacher_ppl"] + (["zero_shot_ppl", "train_tokens"] if trained else [])
    rows = [[r["teacher"], r["policy"], r["init"], r["status"]]
            + [fmt_num((r.get("metrics") or {}).get(k)) for k in keys] + [_ratio_vs_naive(records, r), r["seconds"]]
            for r in records]
    parts = [f"# Grid results ({grid.mode})", f"Base config: `{grid.base}`; cells under `{grid.out}`.",
             md_table(["teacher", "policy", "init", "status", *keys, "naive ppl / ppl", "seconds"], rows)]
    for teacher in grid.axes["teacher"]:
        pivot = [[init] + [fmt_num(next(((r.get("metrics") or {}).get("ppl") for r in records
                                         if (r["teacher"], r["policy"], r["init"]) == (teacher, p, init)), None))
                           for p in grid.axes["policy"]] for init in grid.axes["init"]]
        parts.append(f"## {teacher}: perplexity (rows: init, columns: policy)\n\n"
                     + md_table(["init", *grid.axes["policy"]], pivot))
    if trained:
        parts.append("## Tokens to target\n\n" + "\n\n".join(_tokens_to_target_sections(grid, records)))
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        parts.append("## Failed cells\n\n" + "\n".join(f"- {r['teacher']}/{r['policy']}/{r['init']}: {r['error']}"
                                                        for r in failed))
    atomic_write_text(md_path, "\n\n".join(parts) + "\n")
    return json_path, md_path


def grid_main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="run_grid.py", description="Run an init x policy x teacher grid from a grid file")
    p.add_argument("grid", help="grid YAML (see megatron_tc/eval/grid.py)")
    p.add_argument("--out", help="override the grid's out directory")
    p.add_argument("--force", action="store_true", help="rerun cells that finished before")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    p.add_argument("--list", action="store_true", help="print the cells and exit")
    args = p.parse_args(argv)
    grid = load_grid(args.grid, out=args.out)
    if args.list:
        for c in grid.cells():
            print(c.key, " ".join(c.overrides()))
        return 0
    records = run_grid(grid, force=args.force, fail_fast=args.fail_fast)
    print(os.path.join(grid.out, "results.md"))
    return 0 if all(r["status"] == "ok" for r in records) else 1
