"""The paper-reproduction grid's report (tools/paper/report.py): README.md with the pretraining,
zero-shot and tokens-to-target tables, the goals checked cell by cell, the supplementary sections
(final KL, naive given a longer budget, other seeds, other stage-2 recipes) and the cells not
finished, listed rather than guessed; per teacher x policy a `megatron_tc.eval.report` directory.

Several result roots are read as one grid (a cell in a later root replaces the same cell in an
earlier one). Layout of a root: pretrain/<teacher>/ (pretraining curves),
grid/<part>/<teacher>/<policy>/<init>/ (cell.json, eval_log.jsonl, eval/results.json)."""
from __future__ import annotations

from pathlib import Path

from megatron_tc.config.errors import InputError
from megatron_tc.eval.paper_cells import (KS, KS_LABELS, POLICIES, TEACHERS, cell_curve, cells, logged_curves,
                                          pretrain_section, zero_shot_section)
from megatron_tc.eval.paper_tokens import kl_section, long_naive_results, long_naive_section, tokens_section
from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_ratio, fmt_tokens, md_table


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
                within.append(f"- {teacher} / {policy}, {what}: {fit} vs taylor_calibrate at "
                              f"{' / '.join(KS_LABELS)}: {got}")
    if not rows:
        return "No cell of another stage-2 recipe in these results."
    header = ["teacher", "policy", "recipe", "init", "zero-shot ppl", "final ppl", "final KL",
              *(f"tokens to {lab} (x fewer than the grid's recipe)" for lab in KS_LABELS)]
    return md_table(header, rows) + ("\n\nWithin each recipe:\n\n" + "\n".join(within) if within else "")


def parse_names(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma list of --teachers / --policies, each one of `known`; one error line otherwise."""
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise InputError(f"error: --{what} {text!r}: unknown {bad or 'empty'} (choose from {','.join(known)})")
    return names


def write_paper_report(roots: list[Path], out: Path, variant: str = "taylor_fit", teachers=TEACHERS,
                       policies=POLICIES, grid_eval_logs: list[Path] = ()) -> Path:
    """Write OUT/README.md (and the per-cell reports and plots) from the result roots; returns its path.
    `grid_eval_logs`: directories of <teacher>_<policy>_<init>_eval_log.jsonl, grid cells kept only as
    curves, read where --runs has no such cell."""
    for root in roots:
        if not root.is_dir():
            raise InputError(f"error: {root} does not exist (unpack paper_results.tgz there first)")
    out.mkdir(parents=True, exist_ok=True)
    s2, zs = cells(roots, "stage2", teachers, policies), cells(roots, "zero_shot", teachers, policies)
    logged = {k: v for k, v in logged_curves(list(grid_eval_logs), teachers, policies).items() if k not in s2}
    base = {**logged, **s2}  # every grid cell's stage-2 curve: its directory, or its eval log alone
    zero_table, zero_miss = zero_shot_section(s2, zs, variant, logged)
    long_res = long_naive_results(base, cells(roots, "naive_long", teachers, policies), variant)
    tok_table, tok_miss = tokens_section(base, out, variant, long_res)
    seeds = [("stage2", base), *((part, cells(roots, part, teachers, policies)) for part in SEED_PARTS)]
    expected = {(t, p, i) for t in teachers for p in policies for i in ("naive", "taylor_calibrate", variant)}
    missing = sorted(expected - set(base)) + sorted({(t, p, "zero_gate") for t in teachers for p in policies} - set(zs))
    curves_only = ("\n\nKept only as stage-2 curves (`--grid-eval-logs`; in the tables above, the zero-shot one "
                   "with their step-0 evaluation):\n\n"
                   + "\n".join(f"- {'/'.join(c)}" for c in sorted(logged))) if logged else ""
    scope = "" if (tuple(teachers), tuple(policies)) == (TEACHERS, POLICIES) else \
        f" --teachers {','.join(teachers)} --policies {','.join(policies)}"
    parts = [
        "# Paper grid: zero-shot and tokens-to-target",
        f"Generated by `tools/paper/report.py {' '.join(f'--runs {r}' for r in roots)}"
        f"{''.join(f' --grid-eval-logs {d}' for d in grid_eval_logs)}{scope}` "
        f"(taylor_fit variant: `{variant}`). "
        "Every grid number is one run with run.seed 0 (cells repeated with another seed have their own section); "
        "see docs/results.md for the setup and the commands.",
        "## Teachers pretrained by us\n\n" + pretrain_section(roots, out, teachers),
        "## Zero-shot perplexity and KL(teacher || student) on the evaluation documents\n\n" + zero_table,
        "## Tokens to target (stage 2, same budget and data order for every init)\n\n" + tok_table,
        "## Supplementary: final KL(teacher || student) and tokens to naive's final KL\n\n"
        "Not the targets (those are perplexities, above). KL to the teacher on the evaluation documents is "
        "the quantity stage 2 minimizes; reached and stayed, as above.\n\n" + kl_section(base, variant),
        "## Supplementary: naive given a longer stage-2 budget\n\n"
        "Where naive does not reach a target within the grid's budget, the tokens ratio above is only a lower "
        "bound. This naive run has the same recipe and data order with a longer budget (its cosine schedule "
        f"stretched to it; configs/paper/grid_smollm2_naive_long.yaml); {variant} is the grid's run.\n\n"
        + long_naive_section(long_res, variant),
        "## Supplementary: other seeds\n\n"
        "Each grid cell is one run. These cells ran again with other run.seeds (configs/paper/"
        "grid_smollm2_stage2_seed.yaml and _seed2.yaml: the inits' random parts and the data order drawn anew; the "
        "same text, budget and evaluation), so the gap between taylor_calibrate and taylor_fit can be read against the "
        "spread of either from seed to seed.\n\n" + seed_section(seeds, variant),
        "## Supplementary: other stage-2 recipes\n\n"
        "The grid's cells again with another stage-2 recipe for every init, naive included (same budget, data "
        "order and evaluation; configs/paper/grid_smollm2_<part>.yaml), read against the grid's recipe for "
        "the same init.\n\n" + recipe_section(roots, base, teachers, policies, variant),
        "## Goals, cell by cell\n\n" + ("\n".join(f"- {m}" for m in zero_miss + tok_miss)
                                                    or "- every finished cell meets both goals"),
        "## Cells not finished\n\n" + ("\n".join(f"- {'/'.join(c)}" for c in missing) or "- none") + curves_only,
    ]
    path = out / "README.md"
    atomic_write_text(str(path), "\n\n".join(parts) + "\n")
    return path
