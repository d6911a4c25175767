"""The paper-reproduction grid's result files, read: finished cells per part over several result
roots, cells kept only as their stage-2 curve, and the report's first tables (teachers pretrained by
us, zero-shot perplexity and KL per init). Used by `megatron_tc.eval.paper_report`."""
from __future__ import annotations

import json
from pathlib import Path

from megatron_tc.config.errors import InputError
from megatron_tc.eval.report import fmt_num, fmt_tokens, md_table

KS = (1.10, 1.15, 1.25)
KS_LABELS = tuple(f"{k:.2f}x teacher" for k in KS)  # tokens_to_target's labels of these targets
TEACHERS = ("smollm2", "qwen2", "mistral", "qwen3")
POLICIES = ("uniform", "ar", "stats")
HOWS = (("first reach", False), ("reached and stayed", True))  # tokens_to_target's `stay`


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def cells(roots: list[Path], part: str, teachers=TEACHERS, policies=POLICIES) -> dict[tuple[str, str, str], dict]:
    """(teacher, policy, init) -> {"dir": Path, "cell": cell.json} for the finished cells of a part,
    over several roots (a later root's cell replaces an earlier one's)."""
    out = {}
    for root in roots:
        for path in sorted((root / "grid" / part).glob("*/*/*/cell.json")):
            rec = _json(path)
            d = path.parent
            key = (d.parent.parent.name, d.parent.name, d.name)
            if rec and rec.get("status") == "ok" and key[0] in teachers and key[1] in policies:
                out[key] = {"dir": d, "cell": rec}
    return out


def logged_curves(dirs: list[Path], teachers=TEACHERS, policies=POLICIES) -> dict[tuple[str, str, str], dict]:
    """(teacher, policy, init) -> {"dir": the file} for grid cells that survive only as their stage-2
    curve, <teacher>_<policy>_<init>_eval_log.jsonl in `dirs` (cells kept only as curves): read by
    every section; the zero-shot table takes their step-0 evaluation in place of the eval stage's
    (marked)."""
    suffix, out = "_eval_log.jsonl", {}
    for d in dirs:
        if not d.is_dir():
            raise InputError(f"error: --grid-eval-logs {d}: no such directory")
        for path in sorted(d.glob(f"*{suffix}")):
            teacher, policy, init = (path.name[:-len(suffix)].split("_", 2) + ["", ""])[:3]
            if teacher in teachers and policy in policies and init:
                out[(teacher, policy, init)] = {"dir": path}
    return out


def cell_curve(cells_: dict, key: tuple[str, str, str], name: str | None = None):
    """The stage-2 curve of a cell (its directory, or its eval log alone), named by its init."""
    from megatron_tc.eval.tokens_to_target import load_run

    curve = load_run(str(cells_[key]["dir"]))
    curve.name = name or key[2]
    return curve


def eval_rows(cell_dir: Path) -> dict[str, dict]:
    data = _json(cell_dir / "eval" / "results.json") or {"rows": []}
    return {row["model"]: row for row in data["rows"]}


def pretrain_section(roots: list[Path], out: Path, teachers=TEACHERS) -> str:
    from megatron_tc.eval.plots import plot_ppl_vs_tokens
    from megatron_tc.eval.tokens_to_target import load_run

    rows, curves = [], []
    runs = {run.parent.name: run for root in roots for run in sorted((root / "pretrain").glob("*/pretrain"))}
    for name, run in sorted(runs.items()):
        if name not in teachers:
            continue
        evals = [json.loads(l) for l in (run / "eval_log.jsonl").read_text().splitlines() if l.strip()] \
            if (run / "eval_log.jsonl").is_file() else []
        train = [json.loads(l) for l in (run / "train_log.jsonl").read_text().splitlines() if l.strip()] \
            if (run / "train_log.jsonl").is_file() else []
        manifest = _json(run.parent / "manifest.json") or {}
        secs = (manifest.get("stages", {}).get("pretrain") or {}).get("seconds")
        steady = sorted(r["tokens_per_s"] for r in train[len(train) // 10:])  # the first tenth warms up
        tps = steady[len(steady) // 2] if train else None
        best = min(evals, key=lambda e: e["ppl"]) if evals else None
        rows.append([name, fmt_tokens(evals[-1]["tokens"]) if evals else "—", evals[-1]["step"] if evals else "—",
                     fmt_num(train[-1]["ce"]) if train else "—", fmt_num(evals[-1]["ppl"]) if evals else "—",
                     f"{fmt_num(best['ppl'])} at {fmt_tokens(best['tokens'])}" if best else "—",
                     fmt_num(tps, 3) if tps else "—", fmt_num(secs)])
        if evals:
            curve = load_run(run)
            curve.name = name
            curves.append(curve)
    if not rows:
        return "No pretraining run in these results."
    if curves:
        plot_ppl_vs_tokens(curves, [], out / "pretrain_curves.png", title="Teacher pretraining: held-out perplexity")
    table = md_table(["teacher", "tokens", "steps", "last train CE", "held-out ppl (end)", "best held-out ppl",
                      "median tokens/s", "stage seconds"], rows)
    return table + ("\n\n![pretraining curves](pretrain_curves.png)" if curves else "")


def zero_shot_section(s2: dict, zs: dict, fit: str, logged: dict | None = None) -> tuple[str, list[str]]:
    """Rows per (teacher, policy): teacher ppl, each init's zero-shot ppl and KL, x lower than naive.
    A cell kept only as its curve (`logged`) gives its step-0 evaluation inside stage 2, marked †."""
    inits = ["naive", "zero_gate", "taylor_calibrate", fit]
    rows, misses, from_log = [], [], False
    for teacher in TEACHERS:
        for policy in POLICIES:
            got: dict[str, dict] = {}
            teacher_ppl = None
            for init in ("naive", "taylor_calibrate", fit):
                c = s2.get((teacher, policy, init))
                if c:
                    r = eval_rows(c["dir"])
                    teacher_ppl = (r.get("teacher") or {}).get("ppl", teacher_ppl)
                    label = "naive zero-shot" if init == "naive" else f"{init} zero-shot"
                    if label in r:
                        got[init] = r[label]
                elif (teacher, policy, init) in (logged or {}):
                    curve = cell_curve(logged, (teacher, policy, init))
                    if curve.zero_shot_ppl is not None:  # its evaluation before the first step
                        got[init] = {"ppl": curve.zero_shot_ppl, "kl": curve.kl[0], "mark": "†"}
                        teacher_ppl = teacher_ppl or curve.teacher_ppl
                        from_log = True
            c = zs.get((teacher, policy, "zero_gate"))
            if c:
                got["zero_gate"] = {"ppl": c["cell"]["metrics"]["ppl"], "kl": c["cell"]["metrics"]["kl"]}
            if not got:
                continue
            naive = got.get("naive", {}).get("ppl")
            cellrow = [teacher, policy, fmt_num(teacher_ppl)]
            for init in inits:
                g = got.get(init)
                cellrow.append("—" if g is None else f"{fmt_num(g['ppl'])} / {fmt_num(g['kl'], 3)}{g.get('mark', '')}"
                               + (f" ({naive / g['ppl']:.1f}x)" if naive and init != "naive" else ""))
            rows.append(cellrow)
            present = {i: g["ppl"] for i, g in got.items()}
            if fit in present and len(present) == 4:
                best = min(present, key=present.get)
                if best != fit:
                    misses.append(f"missed: zero-shot {teacher}/{policy}: best is {best} ({fmt_num(present[best])}), "
                                  f"{fit} {fmt_num(present[fit])}")
            else:
                misses.append(f"not finished: zero-shot {teacher}/{policy}: incomplete ({sorted(present)})")
    header = ["teacher", "policy", "teacher ppl", *(f"{i}: ppl / KL (x lower than naive)" for i in inits)]
    note = ("\n\n† a grid cell kept only as its stage-2 curve (`--grid-eval-logs`): the run's own evaluation at "
            "step 0, before any training, in place of the eval stage's (the in-run evaluation may use another "
            "precision, so the two differ slightly)") if from_log else ""
    return md_table(header, rows) + note, misses
