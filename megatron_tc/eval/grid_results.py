"""A grid's results: <out>/results.json (every cell's record), results.md (tables, tokens to
target per (teacher, policy) in pipeline mode) and results.png (perplexity relative to the teacher)."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_ratio, fmt_tokens, md_table

if TYPE_CHECKING:
    from megatron_tc.eval.grid import Grid

UNFINISHED = ("pending", "elsewhere")  # not run by this process (time budget / another process holds it)


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


def bos_convention(records: list[dict[str, Any]]) -> str:
    """One line saying which teachers' evaluation windows start with BOS ('' when no cell recorded it)."""
    by_teacher: dict[str, set] = {}
    for r in records:
        bos = (r.get("metrics") or {}).get("bos")
        if bos is not None:
            by_teacher.setdefault(r["teacher"], set()).add(bool(bos))
    if not by_teacher:
        return ""
    parts = []
    for label, value in (("start with BOS", True), ("have no BOS", False)):
        names = [t for t, v in by_teacher.items() if value in v]
        if names:
            parts.append(f"{label} for {', '.join(names)}")
    return ("Evaluation windows " + "; ".join(parts) + " (each teacher's tokenizer decides; see the BOS "
            "convention in docs/evaluation.md).")


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
    if convention := bos_convention(records):
        parts.append(convention)
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
