#!/usr/bin/env python
"""Tables and plots of the paper-reproduction grid from its result files.

    python tools/paper/report.py --runs DIR [--runs DIR ...] [--out DIR] [--variant taylor_fit]
        [--teachers smollm2,...] [--policies stats,...]

Several --runs roots are read as one grid (a cell in a later root replaces the same cell in an
earlier one), so a grid run in parts can be reported as one. --teachers / --policies restrict the
report (and its list of cells not finished) to part of the grid. Reads runs/pretrain/<teacher>/
(pretraining curves), runs/grid/stage2/<teacher>/<policy>/<init>/ (stage-2 cells: eval_log.jsonl,
eval/results.json) and runs/grid/zero_shot/... (zero_gate cells), and writes OUT/README.md
(pretraining, zero-shot and tokens-to-target tables with ratios and the goals checked cell by cell;
runs/grid/naive_long, runs/grid/stage2_seed{,2} and the other stage-2 recipes' cells,
runs/grid/stage2_{warmup,gdn,lr}, in sections of their own), OUT/pretrain_curves.png and, per
teacher x policy, OUT/<teacher>_<policy>/ (megatron_tc.eval.report: report.md, ppl_vs_tokens.png,
tokens_to_target.json). Cells that are missing or failed are listed, never guessed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_ratio, fmt_tokens, md_table

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
    curve, <teacher>_<policy>_<init>_eval_log.jsonl in `dirs` (cells kept only as curves): read by every section; the zero-shot table takes their step-0
    evaluation in place of the eval stage's (marked)."""
    suffix, out = "_eval_log.jsonl", {}
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(f"error: --grid-eval-logs {d}: no such directory")
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
        tps = sorted(r["tokens_per_s"] for r in train[len(train) // 10:])[len(train[len(train) // 10:]) // 2] if train else None
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


def _tokens_rows(teacher: str, policy: str, res: dict, fit: str, how: str,
                 long_res: dict | None = None) -> tuple[list[list[str]], list[str]]:
    """Table rows of one cell's tokens_to_target result, and the goals it misses. `long_res`:
    taylor_fit against naive with a longer budget (`long_naive_results`), which can settle a goal that the
    budget left 'not shown'."""
    rows, misses = [], []
    by = {r["name"]: r for r in res["runs"]}
    for target in res["targets"]:
        lab = target["label"]
        cell = [teacher, policy, f"{lab} (ppl ≤ {fmt_num(target['ppl'])})"]
        cell += [fmt_tokens(by[i]["tokens"][lab]) if i in by else "—" for i in ("naive", "taylor_calibrate", fit)]
        vs_n = res["ratios"].get("vs_naive", {}).get(fit, {}).get(lab)
        vs_t = res["ratios"].get("vs_taylor_calibrate", {}).get(fit, {}).get(lab)
        rows.append(cell + [fmt_ratio(vs_n), fmt_ratio(vs_t)])
        for base, r, goal in (("naive", vs_n, 10.0), ("taylor_calibrate", vs_t, 1.5)):
            verdict = _goal_verdict(r, goal)
            if not verdict:
                continue
            line = f"{verdict}: tokens ({how}) {teacher}/{policy} {lab}: {fit} vs {base} {fmt_ratio(r)} (goal ≥ {goal}x)"
            if verdict == "not shown":
                line += f"; {base} did not reach it in the budget"
                if base == "naive" and long_res is not None:
                    long_r = long_res["ratios"]["vs_naive_long"][fit][lab]
                    line += (f"; against naive given {_long_factor(long_res, fit):.1f}x the budget: {fmt_ratio(long_r)}, "
                             f"{_goal_verdict(long_r, goal) or 'met'}")
            misses.append(line)
    return rows, misses


def long_naive_results(s2: dict, long_cells: dict, fit: str) -> dict[tuple[str, str, str], dict]:
    """(teacher, policy, how) -> tokens_to_target of taylor_fit (the grid's budget) against naive given a
    longer budget (configs/paper/grid_*_naive_long.yaml), at the teacher-relative targets."""
    from megatron_tc.eval.tokens_to_target import tokens_to_target

    out = {}
    for key in sorted(long_cells):
        teacher, policy, _init = key
        if (teacher, policy, fit) not in s2:
            continue
        long_curve = cell_curve(long_cells, key, "naive_long")
        fit_curve = cell_curve(s2, (teacher, policy, fit))
        for how, stay in HOWS:
            # the grid's targets: its teacher perplexity (the long run's own evaluation of the teacher may
            # differ in the last bits), and no naive-final target (naive= names no run)
            out[(teacher, policy, how)] = tokens_to_target([long_curve, fit_curve], teacher_ppl=fit_curve.teacher_ppl,
                                                           ks=KS, naive="", baselines=("naive_long",), stay=stay)
    return out


def long_naive_section(long_res: dict, fit: str) -> str:
    """The supplementary table: the tokens naive needs with the longer budget, against taylor_fit's."""
    rows, finals = [], []
    for (teacher, policy, how), res in long_res.items():
        by = {r["name"]: r for r in res["runs"]}
        for target in res["targets"]:
            lab = target["label"]
            r = res["ratios"]["vs_naive_long"][fit][lab]
            rows.append([teacher, policy, how, f"{lab} (ppl ≤ {fmt_num(target['ppl'])})",
                         fmt_tokens(by["naive_long"]["tokens"][lab]), fmt_tokens(by[fit]["tokens"][lab]),
                         fmt_ratio(r), _goal_verdict(r, 10.0) or "met"])
        if how == "reached and stayed":
            finals.append(f"- {teacher} / {policy}: naive ends at ppl {fmt_num(by['naive_long']['final_ppl'])} after "
                          f"{fmt_tokens(by['naive_long']['final_tokens'])} tokens ({_long_factor(res, fit):.1f}x the "
                          f"budget); {fit} at {fmt_num(by[fit]['final_ppl'])} after {fmt_tokens(by[fit]['final_tokens'])}")
    if not rows:
        return "No long naive run yet."
    header = ["teacher", "policy", "how", "target", "naive, long budget", f"{fit}, grid budget",
              f"{fit} vs long naive", "goal ≥ 10x"]
    return md_table(header, rows) + "\n\n" + "\n".join(finals)


def _long_factor(res: dict, fit: str) -> float:
    by = {r["name"]: r for r in res["runs"]}
    return by["naive_long"]["final_tokens"] / by[fit]["final_tokens"]


def _goal_verdict(r: dict | None, goal: float) -> str | None:
    """None when a tokens ratio meets the goal; 'missed' when it is known to fall short (or taylor_fit never
    reaches the target); 'not shown' when only a lower bound below the goal is known: the baseline
    never reached the target within the budget, so a longer baseline run would decide."""
    if r is not None and r["bound"] == "zero-shot":
        return None
    if r is None or r["bound"] == "<=":
        return "missed"
    if r["value"] >= goal:
        return None
    return "not shown" if r["bound"] == ">=" else "missed"


def tokens_section(s2: dict, out: Path, fit: str, long_res: dict | None = None) -> tuple[str, list[str]]:
    """Tokens to target per cell, twice: first reach, and reached-and-stayed (a calibrated student
    can rise above a target in its first steps; first reach then credits its zero-shot point)."""
    from megatron_tc.eval.report import write_report
    from megatron_tc.eval.tokens_to_target import tokens_to_target

    rows = {"first reach": [], "reached and stayed": []}
    misses, links = [], []
    for teacher in TEACHERS:
        for policy in POLICIES:
            keys = [(teacher, policy, i) for i in ("naive", "taylor_calibrate", fit) if (teacher, policy, i) in s2]
            if not keys:
                continue
            sub = out / f"{teacher}_{policy}"
            write_report([f"{k[2]}={s2[k]['dir']}" for k in keys], str(sub), ks=KS,
                         title=f"{teacher} / {policy}: stage-2 eval perplexity")
            links.append(f"[{teacher} / {policy}]({sub.name}/report.md)")
            curves = [cell_curve(s2, k) for k in keys]
            for how, stay in HOWS:
                res = tokens_to_target(curves, ks=KS, stay=stay)
                got_rows, got_misses = _tokens_rows(teacher, policy, res, fit, how,
                                                    (long_res or {}).get((teacher, policy, how)))
                rows[how] += got_rows
                misses += got_misses
    header = ["teacher", "policy", "target", "naive", "taylor_calibrate", fit, f"{fit} vs naive", f"{fit} vs taylor_calibrate"]
    text = "\n\n".join(f"{how.capitalize()}:\n\n{md_table(header, r)}" for how, r in rows.items())
    return text + ("\n\nPer cell (curves, plots): " + ", ".join(links) if links else ""), misses


def _kl_curve(curve):
    """The run's KL(teacher || student) curve in a RunCurve's ppl slot (tokens_to_reach reads any
    positive lower-is-better metric), from the points that logged a KL."""
    from megatron_tc.eval.tokens_to_target import RunCurve

    points = [(t, k) for t, k in zip(curve.tokens, curve.kl) if k is not None and k > 0]
    return RunCurve(name=curve.name, tokens=[t for t, _ in points], ppl=[k for _, k in points], source=curve.source)


def kl_section(s2: dict, fit: str) -> str:
    """Final KL per cell, and the tokens each init needs to reach naive's final KL (reached and
    stayed): the distillation objective itself, where the perplexity target at naive's final value
    ties. Supplementary: the targets are perplexities."""
    from megatron_tc.eval.tokens_to_target import ratio, tokens_to_reach

    inits = ("naive", "taylor_calibrate", fit)
    rows = []
    for teacher in TEACHERS:
        for policy in POLICIES:
            if not all((teacher, policy, i) in s2 for i in inits):
                continue
            kl = {i: _kl_curve(cell_curve(s2, (teacher, policy, i))) for i in inits}
            if not all(c.tokens for c in kl.values()):
                continue
            target = kl["naive"].final_ppl
            need = {i: tokens_to_reach(c, target, stay=True) for i, c in kl.items()}
            final = {i: c.final_ppl for i, c in kl.items()}
            rows.append([teacher, policy, " / ".join(f"{final[i]:.4f}" for i in inits),
                         f"{1 - final[fit] / final['naive']:.1%}", f"{1 - final[fit] / final['taylor_calibrate']:.1%}",
                         " / ".join(fmt_tokens(need[i]) for i in inits),
                         fmt_ratio(ratio(kl[fit], need[fit], kl["naive"], need["naive"])),
                         fmt_ratio(ratio(kl[fit], need[fit], kl["taylor_calibrate"], need["taylor_calibrate"]))])
    header = ["teacher", "policy", f"final KL: naive / taylor_calibrate / {fit}", f"{fit} lower than naive",
              f"{fit} lower than taylor_calibrate", f"tokens to naive's final KL: naive / taylor_calibrate / {fit}",
              f"{fit} vs naive", f"{fit} vs taylor_calibrate"]
    return md_table(header, rows) if rows else "No cell with all three inits' KL curves yet."


# every grid part runs on this config; a grid cell kept without its config.yaml ran with its run.seed
PAPER_BASE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "paper" / "base.yaml"


def _run_seed(cell_dir: Path, part: str) -> str:
    """The cell's run.seed as its config.yaml records it; without one, the grid's (`stage2`) is
    PAPER_BASE_CONFIG's and another part is labelled by its name."""
    import yaml

    def seed_in(path: Path):
        return (yaml.safe_load(path.read_text()) or {}).get("run", {}).get("seed") if path.is_file() else None

    seed = seed_in(cell_dir / "config.yaml")
    if seed is None and part == "stage2":
        seed = seed_in(PAPER_BASE_CONFIG)
    return part if seed is None else str(seed)


# grid parts that repeat the stage-2 grid with another run.seed (configs/paper/grid_smollm2_<part>.yaml)
SEED_PARTS = ("stage2_seed", "stage2_seed2")


def seed_section(by_part: list[tuple[str, dict]], fit: str) -> str:
    """taylor_calibrate and taylor_fit in the cells run with other seeds (the SEED_PARTS: another run.seed,
    so other random init parts and data order), beside the grid's run of the same cell (`by_part`:
    (part, cells) with the grid's first): a gap between the two inits reads against how far one init
    moves from seed to seed. Tokens are reached-and-stayed; then the mean over the seeds per init, and each
    later seed set against the first."""
    from megatron_tc.eval.tokens_to_target import ratio, tokens_to_target

    inits = ("taylor_calibrate", fit)
    rows, spread, means = [], [], []
    for teacher in TEACHERS:
        for policy in POLICIES:
            runs = [(part, grid) for part, grid in by_part if all((teacher, policy, i) in grid for i in inits)]
            if len(runs) < 2:
                continue
            per_seed = []
            for part, grid in runs:
                curves = [cell_curve(grid, (teacher, policy, i)) for i in inits]
                res = tokens_to_target(curves, ks=KS, naive="", baselines=("taylor_calibrate",), stay=True)
                seed = _run_seed(grid[(teacher, policy, fit)]["dir"], part)
                rows.append([teacher, policy, seed, *_seed_columns(res, inits)])
                per_seed.append((seed, dict(zip(inits, curves)), {r["name"]: r["tokens"] for r in res["runs"]}))
            means.append(_seed_mean_line(f"{teacher} / {policy}", [tokens for _, _, tokens in per_seed], inits))
            a, ca, ta = per_seed[0]
            for b, cb, tb in per_seed[1:]:
                # tokens(seed b) / tokens(seed a): tokens_to_target's ratio with seed a as the "run"
                ratios = "; ".join(f"{i} " + " / ".join(fmt_ratio(ratio(ca[i], ta[i][lab], cb[i], tb[i][lab]))
                                                        for lab in KS_LABELS) for i in inits)
                spread.append(f"- {teacher} / {policy}: tokens with seed {b} over seed {a} at "
                              f"{' / '.join(KS_LABELS)}: {ratios}")
    if not rows:
        return "No cell run with another seed in these results."
    header = ["teacher", "policy", "run.seed", f"zero-shot ppl: taylor_calibrate / {fit}",
              f"final ppl: taylor_calibrate / {fit}", f"final KL: taylor_calibrate / {fit}",
              *(f"tokens to {k:.2f}x teacher: taylor_calibrate / {fit} ({fit} vs taylor_calibrate)" for k in KS)]
    return (md_table(header, rows) + f"\n\nOver all seeds: mean tokens, taylor_calibrate / {fit} (the ratio of the "
            f"means; the lowest and highest ratio of one seed):\n\n" + "\n".join(means)
            + "\n\nThe same init from seed to seed:\n\n" + "\n".join(spread))


def _seed_mean_line(cell: str, tokens_per_seed: list[dict[str, dict]], inits: tuple[str, str]) -> str:
    """'- cell, N seeds: <target> A / B (ratio, per seed lo-hi); ...' from each seed's tokens per init
    and target (reached and stayed); a target that a seed's run never reached, or met before training,
    has no mean."""
    parts = []
    for label in KS_LABELS:
        per = [[tokens[i][label] for i in inits] for tokens in tokens_per_seed]
        if any(t is None or t == 0 for pair in per for t in pair):
            parts.append(f"{label} no mean (a run did not reach it, or met it before training)")
            continue
        mean_base, mean_ours = (sum(pair[j] for pair in per) / len(per) for j in (0, 1))
        seed_ratios = [base / run for base, run in per]
        parts.append(f"{label} {fmt_tokens(mean_base)} / {fmt_tokens(mean_ours)} ({mean_base / mean_ours:.2f}x, "
                     f"per seed {min(seed_ratios):.2f}-{max(seed_ratios):.2f}x)")
    return f"- {cell}, {len(tokens_per_seed)} seeds: " + "; ".join(parts)


def _seed_columns(res: dict, inits: tuple[str, str]) -> list[str]:
    """'taylor_calibrate / taylor_fit' zero-shot ppl, final ppl, final KL, and tokens (with their ratio) per target."""
    by = {r["name"]: r for r in res["runs"]}

    def both(fmt) -> str:
        return " / ".join(fmt(by[i]) for i in inits)

    cols = [both(lambda r: fmt_num(r["zero_shot_ppl"], 4)), both(lambda r: fmt_num(r["final_ppl"], 4)),
            both(lambda r: f"{r['final_kl']:.4f}")]
    for t in res["targets"]:
        r = res["ratios"]["vs_taylor_calibrate"][inits[1]][t["label"]]
        cols.append(f"{both(lambda run: fmt_tokens(run['tokens'][t['label']]))} ({fmt_ratio(r)})")
    return cols


# grid parts that change the stage-2 recipe for every init (configs/paper/grid_smollm2_<part>.yaml)
RECIPES = {"stage2_warmup": "2-step warmup", "stage2_gdn": "2-step warmup, GDN mixers only",
           "stage2_lr": "half the peak learning rate"}


def recipe_section(roots: list[Path], s2: dict, teachers=TEACHERS, policies=POLICIES, fit: str = "taylor_fit") -> str:
    """Cells of the other stage-2 recipes (RECIPES), each beside the grid's cell of the same teacher,
    policy and init: zero-shot, final ppl / KL and tokens to each target (reached and stayed) with the
    recipe's speed-up over the grid's recipe for that init (tokens(grid) / tokens(recipe)); then taylor_fit
    against taylor_calibrate within each recipe."""
    from megatron_tc.eval.tokens_to_target import tokens_to_target

    rows, within = [], []
    for part, what in RECIPES.items():
        runs = cells(roots, part, teachers, policies)
        for teacher, policy, init in sorted(runs):
            curve = cell_curve(runs, (teacher, policy, init), f"{init}@{part}")
            base = s2.get((teacher, policy, init))
            curves = [curve]
            if base is not None:
                curves.append(cell_curve(s2, (teacher, policy, init)))
            res = tokens_to_target(curves, ks=KS, naive="", baselines=(init,) if base else (), stay=True)
            r = {x["name"]: x for x in res["runs"]}[curve.name]
            cols = [teacher, policy, what, init, fmt_num(r["zero_shot_ppl"], 4), fmt_num(r["final_ppl"], 4),
                    f"{r['final_kl']:.4f}"]
            for lab in KS_LABELS:
                speedup = res["ratios"][f"vs_{init}"][curve.name][lab] if base else None
                cols.append(fmt_tokens(r["tokens"][lab]) + (f" ({fmt_ratio(speedup)})" if base else ""))
            rows.append(cols)
        for teacher in teachers:
            for policy in policies:
                pair = [runs.get((teacher, policy, i)) for i in ("taylor_calibrate", fit)]
                if None in pair:
                    continue
                tc, us = (cell_curve(runs, (teacher, policy, i)) for i in ("taylor_calibrate", fit))
                res = tokens_to_target([tc, us], ks=KS, naive="", baselines=("taylor_calibrate",), stay=True)
                got = " / ".join(fmt_ratio(res["ratios"]["vs_taylor_calibrate"][fit][lab]) for lab in KS_LABELS)
                within.append(f"- {teacher} / {policy}, {what}: {fit} vs taylor_calibrate at {' / '.join(KS_LABELS)}: {got}")
    if not rows:
        return "No cell of another stage-2 recipe in these results."
    header = ["teacher", "policy", "recipe", "init", "zero-shot ppl", "final ppl", "final KL",
              *(f"tokens to {lab} (x fewer than the grid's recipe)" for lab in KS_LABELS)]
    return md_table(header, rows) + ("\n\nWithin each recipe:\n\n" + "\n".join(within) if within else "")


def _names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"error: --{what} {text!r}: unknown {bad or 'empty'} (choose from {','.join(known)})")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, action="append",
                    help="a results root (repeatable; default runs/paper)")
    ap.add_argument("--out", type=Path, default=Path("runs/paper/report"))
    ap.add_argument("--variant", default="taylor_fit")
    ap.add_argument("--teachers", default=",".join(TEACHERS), help="comma list: the teachers to report")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list: the policies to report")
    ap.add_argument("--grid-eval-logs", type=Path, action="append", default=[],
                    help="a dir of <teacher>_<policy>_<init>_eval_log.jsonl: grid cells kept only as curves, read "
                         "where no cell of the grid is in --runs by every section, the zero-shot table with their step-0 evaluation (repeatable)")
    args = ap.parse_args(argv)
    roots = args.runs or [Path("runs/paper")]
    teachers, policies = _names(args.teachers, TEACHERS, "teachers"), _names(args.policies, POLICIES, "policies")
    for root in roots:
        if not root.is_dir():
            print(f"error: {root} does not exist (unpack paper_results.tgz there first)", file=sys.stderr)
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    s2, zs = cells(roots, "stage2", teachers, policies), cells(roots, "zero_shot", teachers, policies)
    logged = {k: v for k, v in logged_curves(args.grid_eval_logs, teachers, policies).items() if k not in s2}
    base = {**logged, **s2}  # every grid cell's stage-2 curve: its directory, or its eval log alone
    zero_table, zero_miss = zero_shot_section(s2, zs, args.variant, logged)
    long_res = long_naive_results(base, cells(roots, "naive_long", teachers, policies), args.variant)
    tok_table, tok_miss = tokens_section(base, args.out, args.variant, long_res)
    seeds = [("stage2", base), *((part, cells(roots, part, teachers, policies)) for part in SEED_PARTS)]
    expected = {(t, p, i) for t in teachers for p in policies for i in ("naive", "taylor_calibrate", args.variant)}
    missing = sorted(expected - set(base)) + sorted({(t, p, "zero_gate") for t in teachers for p in policies} - set(zs))
    curves_only = ("\n\nKept only as stage-2 curves (`--grid-eval-logs`; in the tables above, the zero-shot one "
                   "with their step-0 evaluation):\n\n"
                   + "\n".join(f"- {'/'.join(c)}" for c in sorted(logged))) if logged else ""
    scope = "" if (teachers, policies) == (TEACHERS, POLICIES) else \
        f" --teachers {','.join(teachers)} --policies {','.join(policies)}"
    parts = [
        "# Paper grid: zero-shot and tokens-to-target",
        f"Generated by `tools/paper/report.py {' '.join(f'--runs {r}' for r in roots)}"
        f"{''.join(f' --grid-eval-logs {d}' for d in args.grid_eval_logs)}{scope}` "
        f"(taylor_fit variant: `{args.variant}`). "
        "Every grid number is one run with run.seed 0 (cells repeated with another seed have their own section); "
        "see docs/results.md for the setup and the commands.",
        "## Teachers pretrained by us\n\n" + pretrain_section(roots, args.out, teachers),
        "## Zero-shot perplexity and KL(teacher || student) on the evaluation documents\n\n" + zero_table,
        "## Tokens to target (stage 2, same budget and data order for every init)\n\n" + tok_table,
        "## Supplementary: final KL(teacher || student) and tokens to naive's final KL\n\n"
        "Not the targets (those are perplexities, above). KL to the teacher on the evaluation documents is "
        "the quantity stage 2 minimizes; reached and stayed, as above.\n\n" + kl_section(base, args.variant),
        "## Supplementary: naive given a longer stage-2 budget\n\n"
        "Where naive does not reach a target within the grid's budget, the tokens ratio above is only a lower "
        "bound. This naive run has the same recipe and data order with a longer budget (its cosine schedule "
        f"stretched to it; configs/paper/grid_smollm2_naive_long.yaml); {args.variant} is the grid's run.\n\n"
        + long_naive_section(long_res, args.variant),
        "## Supplementary: other seeds\n\n"
        "Each grid cell is one run. These cells ran again with other run.seeds (configs/paper/"
        "grid_smollm2_stage2_seed.yaml and _seed2.yaml: the inits' random parts and the data order drawn anew; the "
        "same text, budget and evaluation), so the gap between taylor_calibrate and taylor_fit can be read against the "
        "spread of either from seed to seed.\n\n" + seed_section(seeds, args.variant),
        "## Supplementary: other stage-2 recipes\n\n"
        "The grid's cells again with another stage-2 recipe for every init, naive included (same budget, data "
        "order and evaluation; configs/paper/grid_smollm2_<part>.yaml), read against the grid's recipe for "
        "the same init.\n\n" + recipe_section(roots, base, teachers, policies, args.variant),
        "## Goals, cell by cell\n\n" + ("\n".join(f"- {m}" for m in zero_miss + tok_miss)
                                                    or "- every finished cell meets both goals"),
        "## Cells not finished\n\n" + ("\n".join(f"- {'/'.join(c)}" for c in missing) or "- none") + curves_only,
    ]
    atomic_write_text(str(args.out / "README.md"), "\n\n".join(parts) + "\n")
    print(args.out / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
