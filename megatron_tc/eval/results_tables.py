"""The tables and figures of the results pages, generated from the curated result files.

    python tools/results_tables.py [--results docs/results] [--page docs/results.md ...] [--check]

Every `<name>.json` under the results directory has a `kind`:

- `tokens_to_target`: one teacher x policy of the paper grid; its runs (init, run.seed, budget) hold
  their stage-2 evaluation curve (`curve`: tokens, ppl, kl; the point at tokens 0 is the zero-shot
  student) or, for a zero-shot-only run, `zero_shot` (ppl, kl). Tokens to a target are computed here
  from the curves (`megatron_tc.eval.tokens_to_target.tokens_to_reach`, first reach, log-log
  interpolation), never copied.
- `tokens_to_target_summary`: grid cells kept as end points and tokens per target only (no curves).
- `table`: a measured table as it is (`columns`, `rows`), e.g. a benchmark.

Each file also names its date, hardware, software, config and the one command that reproduces it;
the generator prints them under every table. A page receives a block between
`<!-- results:NAME -->` and `<!-- /results:NAME -->` (hand-written text around it is kept). Block
names: the stem of every `table` and `tokens_to_target_summary` file (its own table), and the
combined blocks `smollm2_runs`, `smollm2_tokens`, `at_a_glance` built from all
`tokens_to_target` files. Figures: one PNG per
`tokens_to_target` file (run.seed 0 and the long naive run) in the assets directory.
`--check` writes nothing and exits 1 when a page's block differs from what the files say.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from megatron_tc.eval.report import atomic_write_text, fmt_num, fmt_tokens, md_table
from megatron_tc.eval.tokens_to_target import RunCurve, Target, tokens_to_reach

KINDS = ("tokens_to_target", "tokens_to_target_summary", "table")
REQUIRED = ("kind", "what", "date", "hardware", "software", "config", "command")
INITS = ("naive", "zero_gate", "taylor_calibrate", "taylor_fit")
BLOCK_RE = re.compile(r"<!-- results:([\w.-]+) -->\n.*?<!-- /results:\1 -->", re.S)


class ResultsError(ValueError):
    """A result file or a page that the generator cannot use."""


def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """stem -> parsed file, every *.json of `results_dir`, checked for the keys each kind needs."""
    docs = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        doc = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in doc]
        if missing:
            raise ResultsError(f"{path}: missing {', '.join(missing)}; every result file records {', '.join(REQUIRED)}")
        if doc["kind"] not in KINDS:
            raise ResultsError(f"{path}: kind {doc['kind']!r} is unknown; use one of {', '.join(KINDS)}")
        docs[path.stem] = doc
    if not docs:
        raise ResultsError(f"{results_dir}: no result files (*.json)")
    return docs


def provenance(doc: dict[str, Any]) -> str:
    """The line under a table: when, where, with what, and the command."""
    sw = ", ".join(f"{k} {v}" for k, v in doc["software"].items())
    notes = [doc.get(k) for k in ("bos_note", "baseline_note") if doc.get(k)]
    line = (f"Measured {doc['date']} on {doc['hardware']}; {sw}. Config: `{doc['config']}`. "
            f"Command: `{doc['command']}`.")
    return "\n\n".join([line] + [n.rstrip(".") + "." for n in notes])


def _curve(run: dict[str, Any], teacher_ppl: float) -> RunCurve | None:
    c = run.get("curve")
    if not c:
        return None
    return RunCurve(name=run["init"], tokens=list(c["tokens"]), ppl=list(c["ppl"]), kl=list(c.get("kl", [])),
                    teacher_ppl=teacher_ppl)


def _runs(doc: dict[str, Any], init: str, budget: str = "grid") -> list[dict[str, Any]]:
    return sorted((r for r in doc["runs"] if r["init"] == init and r["budget"] == budget), key=lambda r: r["seed"])


def _zero_shot(run: dict[str, Any]) -> tuple[float, float | None]:
    if "zero_shot" in run:
        return run["zero_shot"]["ppl"], run["zero_shot"].get("kl")
    c = run["curve"]
    if c["tokens"][0] != 0:
        raise ResultsError(f"run {run['init']} seed {run['seed']}: its curve has no zero-shot point (tokens 0)")
    return c["ppl"][0], (c.get("kl") or [None])[0]


def _spread(values: list[float | None], digits: int = 4) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    if len(vals) == 1:
        return fmt_num(float(vals[0]), digits)
    return f"{fmt_num(statistics.fmean(vals), digits)} ({fmt_num(min(vals), digits)}–{fmt_num(max(vals), digits)})"


def _tokens(runs: list[dict[str, Any]], doc: dict[str, Any], k: float) -> list[float | None]:
    return [tokens_to_reach(_curve(r, doc["teacher_ppl"]), k * doc["teacher_ppl"]) for r in runs if r.get("curve")]


def _mean_tokens(tokens: list[float | None]) -> str:
    if not tokens:
        return "—"
    if any(t is None for t in tokens):
        missed = sum(t is None for t in tokens)
        return "not reached" if missed == len(tokens) else f"not reached in {missed} of {len(tokens)}"
    return fmt_tokens(statistics.fmean(tokens))


def smollm2_runs_table(docs: list[dict[str, Any]]) -> str:
    """Zero-shot, final perplexity and final KL per policy and init (mean and range over run.seeds)."""
    rows = []
    for doc in docs:
        for init, budget in [(i, "grid") for i in INITS] + [("naive", "long")]:
            runs = _runs(doc, init, budget)
            if not runs:
                continue
            zs = [_zero_shot(r) for r in runs]
            curves = [r["curve"] for r in runs if r.get("curve")]
            rows.append([doc["policy"], init, fmt_tokens(curves[0]["tokens"][-1]) if curves else "zero-shot only",
                         len(runs), _spread([z[0] for z in zs]), _spread([z[1] for z in zs], 3),
                         _spread([c["ppl"][-1] for c in curves]), _spread([(c.get("kl") or [None])[-1] for c in curves], 3)])
    return md_table(["policy", "init", "stage-2 tokens", "seeds", "zero-shot ppl", "zero-shot KL", "final ppl",
                     "final KL"], rows)


def _ratio_of_means(base: list[float | None], run: list[float | None]) -> str:
    if not base or not run or None in base or None in run:
        return "—"
    if statistics.fmean(run) == 0:
        return "∞ (met zero-shot)"
    per_seed = [b / r for b, r in zip(base, run) if r > 0]
    spread = f" ({min(per_seed):.2f}–{max(per_seed):.2f}x per seed)" if len(per_seed) > 1 else ""
    return f"{statistics.fmean(base) / statistics.fmean(run):.2f}x{spread}"


def _vs_naive(naive: list[float | None], naive_runs: list[dict[str, Any]], run: list[float | None]) -> str:
    if not naive or not run or None in run:
        return "—"
    mean = statistics.fmean(run)
    if naive[0] is None:
        return f"≥ {naive_runs[0]['curve']['tokens'][-1] / mean:.2f}x" if mean > 0 else "—"
    return f"{naive[0] / mean:.2f}x" if mean > 0 else "∞ (met zero-shot)"


def smollm2_tokens_table(docs: list[dict[str, Any]]) -> str:
    """Tokens to k x the teacher's perplexity per policy (means over run.seeds) and the ratios."""
    rows = []
    for doc in docs:
        long_runs = _runs(doc, "naive", "long")
        for k in doc["targets_x_teacher"]:
            naive, long_naive = _tokens(_runs(doc, "naive"), doc, k), _tokens(long_runs, doc, k)
            tc, tf = _tokens(_runs(doc, "taylor_calibrate"), doc, k), _tokens(_runs(doc, "taylor_fit"), doc, k)
            rows.append([doc["policy"], f"{k:.2f}x teacher (ppl ≤ {fmt_num(k * doc['teacher_ppl'])})",
                         _mean_tokens(naive), _mean_tokens(long_naive), _mean_tokens(tc), _mean_tokens(tf),
                         _vs_naive(long_naive, long_runs, tf), _ratio_of_means(tc, tf)])
    return md_table(["policy", "target", "naive", "naive, 4.5x budget", "taylor_calibrate (mean of seeds)",
                     "taylor_fit (mean of seeds)", "taylor_fit vs naive, 4.5x budget", "taylor_fit vs taylor_calibrate"],
                    rows)


def at_a_glance_table(docs: list[dict[str, Any]]) -> str:
    """One row per policy: zero-shot perplexity and tokens to 1.10x the teacher, for the README."""
    rows = []
    for doc in docs:
        k = min(doc["targets_x_teacher"])
        zs = {i: statistics.fmean(_zero_shot(r)[0] for r in _runs(doc, i)) for i in ("naive", "taylor_calibrate", "taylor_fit")}
        tc, tf = _tokens(_runs(doc, "taylor_calibrate"), doc, k), _tokens(_runs(doc, "taylor_fit"), doc, k)
        long_runs = _runs(doc, "naive", "long")
        rows.append([f"{doc['teacher']} / {doc['policy']}", fmt_num(doc["teacher_ppl"]),
                     " / ".join(fmt_num(zs[i]) for i in zs),
                     " / ".join(_mean_tokens(t) for t in (_tokens(long_runs, doc, k), tc, tf)),
                     _ratio_of_means(tc, tf).split(" (")[0]])
    return md_table(["teacher / policy", "teacher ppl", "zero-shot ppl: naive / taylor_calibrate / taylor_fit",
                     "tokens to 1.10x teacher ppl: naive (4.5x budget) / taylor_calibrate / taylor_fit",
                     "taylor_fit fewer tokens than taylor_calibrate"], rows)


def summary_table(doc: dict[str, Any]) -> str:
    """tokens_to_target_summary: per cell, zero-shot perplexity and tokens to each teacher-relative
    target (first reach), with taylor_fit's ratios at the first (tightest) target."""
    inits = ("naive", "taylor_calibrate", "taylor_fit")
    rows = []
    for cell in doc["cells"]:
        runs = cell["runs"]
        labels = [t for t in cell["targets_ppl"] if t.endswith("teacher")]
        tok = {i: [runs[i]["tokens_to_target"][label] for label in labels] for i in inits}
        ratios = []
        for base in ("naive", "taylor_calibrate"):
            b, r = tok[base][0], tok["taylor_fit"][0]
            ratios.append("—" if b is None or r is None else "∞ (met zero-shot)" if r == 0 else f"{b / r:.2f}x")
        rows.append([cell["teacher"], cell["policy"], fmt_num(cell["teacher_ppl"]),
                     " / ".join(fmt_num(runs[i]["zero_shot_ppl"]) for i in inits),
                     *(" / ".join(fmt_tokens(t).replace(" (zero-shot)", "") for t in tok[i]) for i in inits), *ratios])
    first = labels[0] if doc["cells"] else "first target"
    return md_table(["teacher", "policy", "teacher ppl", "zero-shot ppl: naive / taylor_calibrate / taylor_fit",
                     *(f"{i}: tokens to {' / '.join(x.split()[0] for x in labels)} teacher ppl" for i in inits),
                     f"taylor_fit vs naive at {first}", f"taylor_fit vs taylor_calibrate at {first}"], rows)


def plain_table(doc: dict[str, Any]) -> str:
    return md_table(doc["columns"], [[fmt_num(c) if isinstance(c, float) else c for c in row] for row in doc["rows"]])


def blocks(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """block name -> markdown (a table and, for a single file, its provenance)."""
    out = {}
    grid = [d for d in results.values() if d["kind"] == "tokens_to_target"]
    for name, doc in results.items():
        if doc["kind"] != "tokens_to_target":  # those are published through the combined blocks
            table = summary_table(doc) if doc["kind"] == "tokens_to_target_summary" else plain_table(doc)
            out[name] = f"{table}\n\n{provenance(doc)}"
    if grid:
        order = {"uniform": 0, "ar": 1, "stats": 2}
        grid.sort(key=lambda d: (d["teacher"], order.get(d["policy"], 9), d["policy"]))
        note = provenance(grid[0]).replace(f"--policies {grid[0]['policy']}", "--policies POLICY")
        out["smollm2_runs"] = f"{smollm2_runs_table(grid)}\n\n{note}"
        out["smollm2_tokens"] = f"{smollm2_tokens_table(grid)}\n\n{note}"
        out["at_a_glance"] = at_a_glance_table(grid)
    return out


def render_page(text: str, generated: dict[str, str], page: str) -> str:
    """`text` with each marked block replaced; a marker naming no generated block is an error."""
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in generated:
            raise ResultsError(f"{page}: block 'results:{name}' names no result file; "
                               f"known: {', '.join(sorted(generated))}")
        return f"<!-- results:{name} -->\n{generated[name]}\n<!-- /results:{name} -->"
    return BLOCK_RE.sub(sub, text)


def write_figures(results: dict[str, dict[str, Any]], assets: Path) -> list[Path]:
    """ppl vs tokens per tokens_to_target file: run.seed 0 of every init and the long naive run."""
    import matplotlib

    from megatron_tc.eval.plots import plot_ppl_vs_tokens

    written = []
    for name, doc in results.items():
        if doc["kind"] != "tokens_to_target":
            continue
        curves = []
        for run in doc["runs"]:
            if run.get("curve") and run["seed"] == 0:
                curve = _curve(run, doc["teacher_ppl"])
                curve.name = run["init"] + (", 4.5x budget" if run["budget"] == "long" else "")
                curves.append(curve)
        targets = [Target(f"{k:.2f}x teacher", k * doc["teacher_ppl"]) for k in doc["targets_x_teacher"]]
        assets.mkdir(parents=True, exist_ok=True)
        with matplotlib.rc_context({"savefig.dpi": 72}):  # small PNGs: they are committed
            written.append(Path(plot_ppl_vs_tokens(curves, targets, assets / f"{name}.png",
                                                   title=f"{doc['teacher']} / {doc['policy']}: stage-2 eval perplexity",
                                                   teacher_ppl=doc["teacher_ppl"])))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=Path("docs/results"), help="the curated result files")
    ap.add_argument("--page", type=Path, action="append",
                    help="a page with marked blocks (repeatable; default every docs/*.md and README.md)")
    ap.add_argument("--assets", type=Path, default=Path("docs/assets"), help="where the figures go")
    ap.add_argument("--no-figures", action="store_true", help="tables only")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = ap.parse_args(argv)
    pages = args.page or [*sorted(Path("docs").glob("*.md")), Path("README.md")]
    try:
        generated = blocks(load_results(args.results))
        stale = []
        for page in pages:
            if not page.is_file():
                raise ResultsError(f"{page}: no such page")
            text = page.read_text()
            new = render_page(text, generated, str(page))
            if new != text:
                stale.append(page)
                if not args.check:
                    atomic_write_text(str(page), new)
    except (ResultsError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        for page in stale:
            print(f"error: {page} is out of date with {args.results}; run python tools/results_tables.py",
                  file=sys.stderr)
        return 1 if stale else 0
    if not args.no_figures:
        write_figures(load_results(args.results), args.assets)
    for page in stale:
        print(f"updated {page}")
    return 0
