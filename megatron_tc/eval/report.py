"""Markdown report (tables + figures) from a set of stage-2 run directories.

Each run directory holds `eval_log.jsonl` or TensorBoard events (see `tokens_to_target`), an optional
`run.json`, and optionally the outputs of other evaluations, which get their own tables:
`eval.json` (tools/evaluate.py --json), `long_context.json` (`long_context.run_probe`) and
`lm_eval.json` (`python -m megatron_tc.eval.harness --out`).

`write_report(runs, out_dir)` writes `report.md`, `ppl_vs_tokens.png` and `tokens_to_target.json`.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from typing import Any, Iterable, Sequence

from megatron_tc.config.errors import InputError, command_line
from megatron_tc.eval.plots import plot_ppl_vs_tokens
from megatron_tc.eval.tokens_to_target import (DEFAULT_KS, EvalLogError, RunCurve, Target, load_run,
                                               tokens_to_target)


def fmt_tokens(t: float | None) -> str:
    if t is None:
        return "not reached"
    if t == 0:
        return "0 (zero-shot)"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if t >= div:
            return f"{t / div:.3g}{unit}"
    return f"{t:.0f}"


def fmt_ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    if r["bound"] == "zero-shot":
        return "∞ (met zero-shot)"
    value = f"{r['value']:.2f}x"
    return {"=": value, ">=": f"≥ {value}", "<=": f"≤ {value}"}[r["bound"]]


def fmt_num(x: Any, digits: int = 4) -> str:
    return "—" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _read_json(path: str) -> Any | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _runs_section(result: dict[str, Any]) -> str:
    bos = {True: "yes", False: "no"}  # whether the run's windows start with BOS (run.json; "—" before it was recorded)
    rows = [[r["name"], r["meta"].get("init", "—"), r["meta"].get("policy", "—"), r["meta"].get("teacher", "—"),
             bos.get(r["meta"].get("bos"), "—"), fmt_num(r["zero_shot_ppl"]), fmt_num(r["final_ppl"]),
             fmt_num(r["final_kl"]), fmt_tokens(r["final_tokens"])] for r in result["runs"]]
    return md_table(["run", "init", "policy", "teacher", "BOS", "zero-shot ppl", "final ppl", "final KL",
                     "tokens trained"], rows)


def _targets_section(result: dict[str, Any]) -> str:
    header = ["run"] + [f"{t['label']} (ppl ≤ {t['ppl']:.4g})" for t in result["targets"]]
    rows = [[r["name"]] + [fmt_tokens(r["tokens"][t["label"]]) for t in result["targets"]] for r in result["runs"]]
    parts = [md_table(header, rows)]
    for key, table in result["ratios"].items():
        base = key.removeprefix("vs_")
        parts.append(f"\nTimes fewer tokens than `{base}` (tokens({base}) / tokens(run)):\n")
        parts.append(md_table(["run"] + [t["label"] for t in result["targets"]],
                              [[name] + [fmt_ratio(cells[t["label"]]) for t in result["targets"]]
                               for name, cells in table.items()]))
    return "\n".join(parts)


def _extra_sections(run_dirs: Sequence[str], names: Sequence[str]) -> list[str]:
    out = []
    evals = [(n, _read_json(os.path.join(d, "eval.json"))) for d, n in zip(run_dirs, names)]
    evals = [(n, e) for n, e in evals if e]
    if evals:
        out.append("## Held-out evaluation (tools/evaluate.py)\n\n" + md_table(
            ["run", "ppl", "teacher ppl", "KL (nats/token)", "top-1 agree", "tokens", "seq len"],
            [[n, fmt_num(e.get("ppl")), fmt_num(e.get("teacher_ppl")), fmt_num(e.get("kl")),
              fmt_num(e.get("top1_agree")), e.get("tokens"), e.get("seq_len")] for n, e in evals]))
    probes = [(n, _read_json(os.path.join(d, "long_context.json"))) for d, n in zip(run_dirs, names)]
    probes = [(n, p) for n, p in probes if p]
    if probes:
        rows = []
        for n, probe in probes:
            for model, per_len in probe["accuracy"].items():
                rows.append([n, model] + [fmt_num(per_len.get(str(L))) for L in probe["lengths"]])
        out.append("## Long-context retrieval probe (accuracy)\n\n" + md_table(
            ["run", "model"] + [str(L) for L in probes[0][1]["lengths"]], rows))
    harness = [(n, _read_json(os.path.join(d, "lm_eval.json"))) for d, n in zip(run_dirs, names)]
    harness = [(n, h) for n, h in harness if h]
    if harness:
        rows = [[n, task, metric, fmt_num(v)] for n, h in harness for task, metrics in h.items()
                for metric, v in metrics.items() if isinstance(v, float) and "stderr" not in metric]
        out.append("## lm-evaluation-harness\n\n" + md_table(["run", "task", "metric", "value"], rows))
    return out


def load_named_runs(specs: Sequence[str]) -> tuple[list[str], list[RunCurve]]:
    """Runs given as PATH or NAME=PATH (a run dir or an eval_log.jsonl; NAME replaces the name the run
    would get from its run.json or folder, e.g. for logs copied side by side). Returns (paths, curves)."""
    paths, curves = [], []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or os.sep in name or os.path.exists(spec):  # a path that holds '='
            name, path = None, spec
        curve = load_run(path)
        if name:
            curve.name = name
        paths.append(path)
        curves.append(curve)
    return paths, curves  # names must differ: tokens_to_target refuses duplicates


def write_report(run_dirs: Sequence[str], out_dir: str, teacher_ppl: float | None = None,
                 ks: Iterable[float] = DEFAULT_KS, method: str = "interpolate", title: str = "Distillation report",
                 naive: str = "naive", baselines: Sequence[str] | None = None) -> str:
    """Write report.md + ppl_vs_tokens.png + tokens_to_target.json into out_dir; returns report.md's path.
    `run_dirs`: PATH or NAME=PATH each (`load_named_runs`); `baselines`: the runs the others are
    compared with (default: the naive run and taylor_calibrate)."""
    run_dirs, curves = load_named_runs(run_dirs)
    unknown = sorted(set(baselines or ()) - {c.name for c in curves})
    if unknown:
        raise EvalLogError(f"baselines {unknown} name no run (runs: {[c.name for c in curves]})")
    result = tokens_to_target(curves, teacher_ppl=teacher_ppl, ks=ks, method=method, naive=naive,
                              baselines=baselines or (naive, "taylor_calibrate"))
    os.makedirs(out_dir, exist_ok=True)
    targets = [Target(t["label"], t["ppl"]) for t in result["targets"]]
    plot_ppl_vs_tokens(curves, targets, os.path.join(out_dir, "ppl_vs_tokens.png"), title=title,
                       teacher_ppl=result["teacher_ppl"])
    atomic_write_text(os.path.join(out_dir, "tokens_to_target.json"), json.dumps(result, indent=2) + "\n")
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    sections = [
        f"# {title}",
        f"Generated {when} from {len(curves)} runs: " + ", ".join(f"`{d}`" for d in run_dirs) + ".",
        "## Runs\n\n" + _runs_section(result),
        f"## Tokens to target\n\nTeacher perplexity: {fmt_num(result['teacher_ppl'])}. Crossing point: "
        f"`{method}` ({'log-ppl linear in log-tokens between eval points' if method == 'interpolate' else 'first eval point at or below the target'}).\n\n"
        + _targets_section(result),
        "## Eval perplexity vs tokens\n\n![eval perplexity vs training tokens](ppl_vs_tokens.png)",
        *_extra_sections(run_dirs, [c.name for c in curves]),
    ]
    path = os.path.join(out_dir, "report.md")
    atomic_write_text(path, "\n\n".join(sections) + "\n")
    return path


@command_line
def report_main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="report.py", description="Markdown report (tables + PNG) from stage-2 run dirs")
    p.add_argument("runs", nargs="+", help="run directories (eval_log.jsonl or TensorBoard events inside) or "
                   "eval_log.jsonl files, each optionally as NAME=PATH")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--teacher-ppl", type=float, help="teacher perplexity (default: teacher_ppl in the logs)")
    p.add_argument("--ks", default=",".join(str(k) for k in DEFAULT_KS), help="target factors x teacher ppl")
    p.add_argument("--method", default="interpolate", choices=["interpolate", "first"])
    p.add_argument("--naive", default="naive", help="name of the naive run (its final ppl is a target)")
    p.add_argument("--baselines", help="comma list: the runs the others are compared with "
                   "(default: the --naive run and taylor_calibrate)")
    p.add_argument("--title", default="Distillation report")
    args = p.parse_args(argv)
    try:
        ks = [float(k) for k in args.ks.split(",")]
    except ValueError:
        raise InputError(f"error: --ks {args.ks!r}: give comma-separated factors, e.g. 1.5,1.25,1.1") from None
    try:
        path = write_report(args.runs, args.out, teacher_ppl=args.teacher_ppl, ks=ks, method=args.method,
                            title=args.title, naive=args.naive,
                            baselines=args.baselines.split(",") if args.baselines else None)
    except EvalLogError as err:  # a run that is not there or whose log cannot give the report
        raise InputError(f"error: {err}") from None
    print(path)
    return 0
