"""Tokens-to-target sections of the paper-grid report: per cell and target, first reach and
reached-and-stayed, the goals checked (10x fewer tokens than naive, 1.5x fewer than
taylor_calibrate), naive given a longer budget, and the final KL to the teacher."""
from __future__ import annotations

from pathlib import Path

from megatron_tc.eval.paper_cells import HOWS, KS, POLICIES, TEACHERS, cell_curve
from megatron_tc.eval.report import fmt_num, fmt_ratio, fmt_tokens, md_table


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
            line = (f"{verdict}: tokens ({how}) {teacher}/{policy} {lab}: {fit} vs {base} {fmt_ratio(r)} "
                    f"(goal ≥ {goal}x)")
            if verdict == "not shown":
                line += f"; {base} did not reach it in the budget"
                if base == "naive" and long_res is not None:
                    long_r = long_res["ratios"]["vs_naive_long"][fit][lab]
                    line += (f"; against naive given {_long_factor(long_res, fit):.1f}x the budget: "
                             f"{fmt_ratio(long_r)}, {_goal_verdict(long_r, goal) or 'met'}")
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
                          f"budget); {fit} at {fmt_num(by[fit]['final_ppl'])} after "
                          f"{fmt_tokens(by[fit]['final_tokens'])}")
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
    header = ["teacher", "policy", "target", "naive", "taylor_calibrate", fit, f"{fit} vs naive",
              f"{fit} vs taylor_calibrate"]
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
