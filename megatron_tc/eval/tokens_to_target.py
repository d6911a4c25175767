"""Tokens-to-target: how many distillation tokens each stage-2 run needs to reach a perplexity target.

Eval log format (written by stage 2, read here) — `<run_dir>/eval_log.jsonl`, one JSON object per
evaluation point, appended as training goes::

    {"step": 200, "tokens": 819200, "ppl": 41.7, "kl": 0.52, "top1_agree": 0.71, "teacher_ppl": 35.8}

- `tokens` (required): training tokens the student has consumed when the evaluation ran, summed
  over data-parallel ranks (`train_tokens`, if present, is used instead). Log the zero-shot
  evaluation before the first step as tokens = 0. Two different steps with the same tokens are
  refused (that is an eval token count, not training tokens).
- `ppl` (required): perplexity on the held-out evaluation set; `kl`, `top1_agree` optional.
- `teacher_ppl` (optional, on any line): the teacher's perplexity on the same evaluation set.
- Lines repeated after a resume are fine: the last line for a given `tokens` wins.
- Optional `<run_dir>/run.json`: {"name": ..., "init": ..., "policy": ..., "teacher": ...}. The
  run's name is run.json's "name", else its "init", else the directory name.

TensorBoard instead (when there is no eval_log.jsonl): event files under the run directory, either
stage 2's `stage2_eval_vs_tokens/{ppl,kl}` (global step = training tokens), or `eval/ppl` with
`eval/tokens` at the same global step (if there is no eval/tokens, the step is read as tokens) and
optional `eval/kl`; the teacher from `eval/teacher_ppl` or `stage2_eval/teacher_ppl`.

Targets: ppl <= k x teacher_ppl for k in (1.10, 1.15, 1.25), and ppl <= the naive run's final ppl.

Crossing point (`method`):
- "interpolate" (default): with eval points (t0, p0) above the target and (t1, p1) the first at or
  below it, log(ppl) is taken as linear in log(tokens) between them:
  f = (log p0 - log target) / (log p0 - log p1), tokens = exp(log t0 + f (log t1 - log t0)).
  If t0 = 0 (the zero-shot point), log(t0) is undefined and tokens = f * t1 (linear in tokens).
- "first": the tokens of the first eval point at or below the target (an upper bound).
A run already at or below the target at its first point reaches it at that point's tokens.
A run that never gets there is "not reached" (None).
With `stay`, the crossing is the one after the run's last point above the target ("reached and
stayed"; a run that ends above it is "not reached").

Ratios (run X vs baseline B, per target): tokens(B) / tokens(X), i.e. "X needs this many times fewer
tokens". If X reaches the target and B does not, the ratio is a lower bound ">= B's last tokens /
tokens(X)"; if B reaches it and X does not, an upper bound "<= tokens(B) / X's last tokens"; if
neither does, there is no ratio.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

DEFAULT_KS = (1.10, 1.15, 1.25)
EVAL_LOG = "eval_log.jsonl"
RUN_META = "run.json"


class EvalLogError(ValueError):
    """An eval log that cannot be read as a stage-2 perplexity curve."""


@dataclass
class RunCurve:
    """Eval points of one run, sorted by tokens (unique)."""

    name: str
    tokens: list[float]
    ppl: list[float]
    kl: list[float | None] = field(default_factory=list)
    teacher_ppl: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def final_ppl(self) -> float:
        return self.ppl[-1]

    @property
    def final_tokens(self) -> float:
        return self.tokens[-1]

    @property
    def zero_shot_ppl(self) -> float | None:
        return self.ppl[0] if self.tokens[0] == 0 else None


@dataclass
class Target:
    label: str
    ppl: float


def _curve(name: str, points: dict[float, dict[str, Any]], teacher_ppl: float | None, meta: dict[str, Any],
           source: str) -> RunCurve:
    if not points:
        raise EvalLogError(f"{source}: no eval points (need lines with 'tokens' and 'ppl')")
    ts = sorted(points)
    for t in ts:
        p = points[t]["ppl"]
        if not (isinstance(p, (int, float)) and p > 0):
            raise EvalLogError(f"{source}: ppl {p!r} at tokens={t} is not a positive number")
    return RunCurve(name=name, tokens=ts, ppl=[float(points[t]["ppl"]) for t in ts],
                    kl=[points[t].get("kl") for t in ts], teacher_ppl=teacher_ppl, meta=meta, source=source)


def read_jsonl_log(path: str | os.PathLike, name: str | None = None, meta: dict[str, Any] | None = None) -> RunCurve:
    """Read an eval_log.jsonl (format in the module doc). `train_tokens`, if present, wins over `tokens`."""
    points: dict[float, dict[str, Any]] = {}
    step_at: dict[float, Any] = {}
    teacher = None
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if lineno > 1 and not line.endswith("\n"):  # a final line cut by a kill mid-write
                    break
                raise EvalLogError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            tokens = rec.get("train_tokens", rec.get("tokens"))
            if tokens is None or "ppl" not in rec:
                raise EvalLogError(f"{path}:{lineno}: needs 'tokens' and 'ppl' (got keys {sorted(rec)})")
            tokens = float(tokens)
            step = rec.get("step")
            if step is not None and step_at.get(tokens, step) != step:
                raise EvalLogError(f"{path}:{lineno}: steps {step_at[tokens]} and {step} both report tokens={tokens:g}; "
                                   "'tokens' must be the training tokens consumed (is it the eval token count?)")
            step_at[tokens] = step
            points[tokens] = rec
            teacher = rec.get("teacher_ppl", teacher)
    return _curve(name or os.path.basename(os.path.dirname(os.path.abspath(path))), points, teacher,
                  meta or {}, str(path))


# TensorBoard layouts, tried in order: (ppl tag, tokens tag or None = the step is tokens, kl tag)
TB_LAYOUTS = (
    ("stage2_eval_vs_tokens/ppl", None, "stage2_eval_vs_tokens/kl"),  # megatron_tc.distill.stage2
    ("eval/ppl", "eval/tokens", "eval/kl"),
)
TB_TEACHER_TAGS = ("eval/teacher_ppl", "stage2_eval/teacher_ppl", "stage2_eval_vs_tokens/teacher_ppl")


def read_tensorboard_log(run_dir: str | os.PathLike, name: str | None = None,
                         meta: dict[str, Any] | None = None) -> RunCurve:
    """Read eval scalars from TensorBoard event files under `run_dir` (tags in the module doc)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True))
    if not files:
        raise EvalLogError(f"{run_dir}: neither {EVAL_LOG} nor TensorBoard event files found")
    scalars: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if "eval" in tag:
                scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    layout = next((lay for lay in TB_LAYOUTS if lay[0] in scalars), None)
    if layout is None:
        raise EvalLogError(f"{run_dir}: TensorBoard logs have none of {[lay[0] for lay in TB_LAYOUTS]} "
                           f"(eval scalars found: {sorted(scalars)})")
    ppl_tag, tokens_tag, kl_tag = layout
    tokens_at = scalars.get(tokens_tag, {}) if tokens_tag else {}
    points = {}
    for step, ppl in scalars[ppl_tag].items():
        if tokens_at and step not in tokens_at:
            raise EvalLogError(f"{run_dir}: {ppl_tag} at step {step} has no {tokens_tag} at the same step")
        t = tokens_at[step] if tokens_at else step
        points[float(t)] = {"ppl": ppl, "kl": scalars.get(kl_tag, {}).get(step)}
    teacher_vals = [v for tag in TB_TEACHER_TAGS for v in scalars.get(tag, {}).values()]
    return _curve(name or os.path.basename(os.path.abspath(run_dir)), points,
                  teacher_vals[-1] if teacher_vals else None, meta or {}, str(run_dir))


def load_run(path: str | os.PathLike) -> RunCurve:
    """A run directory (its eval_log.jsonl, at the top or the only one below; else TensorBoard events)
    or an eval_log.jsonl file."""
    path = str(path)
    if os.path.isfile(path):
        return read_jsonl_log(path)
    if not os.path.isdir(path):
        raise EvalLogError(f"{path}: no such run directory or log file")
    meta = {}
    if os.path.isfile(os.path.join(path, RUN_META)):
        with open(os.path.join(path, RUN_META), encoding="utf-8") as fh:
            meta = json.load(fh)
    name = meta.get("name") or meta.get("init") or os.path.basename(os.path.abspath(path))
    log = os.path.join(path, EVAL_LOG)
    if not os.path.isfile(log):  # e.g. <run_dir>/stage2/eval_log.jsonl
        found = sorted(glob.glob(os.path.join(path, "**", EVAL_LOG), recursive=True))
        if len(found) > 1:
            raise EvalLogError(f"{path}: several {EVAL_LOG} files ({found}); pass the one to use")
        log = found[0] if found else log
    if os.path.isfile(log):
        return read_jsonl_log(log, name=name, meta=meta)
    return read_tensorboard_log(path, name=name, meta=meta)


def tokens_to_reach(curve: RunCurve, target: float, method: str = "interpolate", stay: bool = False) -> float | None:
    """Tokens at which `curve` first reaches ppl <= target (None: not reached); see module doc.

    stay=True: the tokens from which it stays at or below the target for the rest of the run (the
    crossing after its last point above the target), so that a calibrated start that first rises
    under training is not credited with its zero-shot point.
    """
    if method not in ("interpolate", "first"):
        raise ValueError(f"method {method!r}: use 'interpolate' or 'first'")
    start = 0
    if stay:
        above = [i for i, p in enumerate(curve.ppl) if p > target]
        start = above[-1] if above else 0
    for i, (t1, p1) in enumerate(zip(curve.tokens, curve.ppl)):
        if i < start or p1 > target:
            continue
        if i == 0 or method == "first" or p1 == target:
            return t1
        t0, p0 = curve.tokens[i - 1], curve.ppl[i - 1]
        f = (math.log(p0) - math.log(target)) / (math.log(p0) - math.log(p1))
        if t0 <= 0:
            return f * t1
        return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return None


def make_targets(teacher_ppl: float | None, naive: RunCurve | None, ks: Iterable[float] = DEFAULT_KS) -> list[Target]:
    targets = []
    if teacher_ppl is not None:
        targets += [Target(f"{k:.2f}x teacher", k * teacher_ppl) for k in ks]
    if naive is not None:
        targets.append(Target("naive final", naive.final_ppl))
    if not targets:
        raise EvalLogError("no targets: give the teacher's perplexity (teacher_ppl in the logs or --teacher-ppl) "
                           "or a run named 'naive'")
    return targets


def ratio(run: RunCurve, run_tokens: float | None, base: RunCurve, base_tokens: float | None) -> dict[str, Any] | None:
    """{'value': tokens(base)/tokens(run), 'bound': '=' | '>=' | '<='}; {'value': None, 'bound': 'zero-shot'}
    when the run meets the target before training; None when neither reaches it."""
    if run_tokens == 0:  # target met zero-shot: no finite ratio (JSON has no inf)
        return {"value": None, "bound": "zero-shot"}
    if run_tokens is not None and base_tokens is not None:
        return {"value": base_tokens / run_tokens, "bound": "="}
    if run_tokens is not None:
        return {"value": base.final_tokens / run_tokens, "bound": ">="}
    if base_tokens is not None:
        return {"value": base_tokens / run.final_tokens, "bound": "<="}
    return None


def _teacher_ppl(curves: list[RunCurve], teacher_ppl: float | None) -> float | None:
    if teacher_ppl is not None:
        return teacher_ppl
    found = [c.teacher_ppl for c in curves if c.teacher_ppl is not None]
    if found and max(found) > min(found) * (1 + 1e-6):
        raise EvalLogError(f"runs disagree on teacher_ppl ({sorted(set(found))}): were they evaluated on "
                           "different text? Pass teacher_ppl explicitly")
    return found[0] if found else None


def tokens_to_target(curves: list[RunCurve], teacher_ppl: float | None = None, ks: Iterable[float] = DEFAULT_KS,
                     method: str = "interpolate", naive: str = "naive",
                     baselines: Iterable[str] = ("naive", "taylor_calibrate"), stay: bool = False) -> dict[str, Any]:
    """The tokens-to-target table and ratios for `curves` (JSON-ready; format in the module doc;
    `stay`: tokens from which each run stays at or below the target)."""
    names = [c.name for c in curves]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalLogError(f"several runs are named {dup} (sources: {[c.source for c in curves]}); set 'name' in "
                           "each run.json, or name each one with NAME=PATH (tools/report.py)")
    by_name = {c.name: c for c in curves}
    teacher = _teacher_ppl(curves, teacher_ppl)
    targets = make_targets(teacher, by_name.get(naive), ks)
    reached = {c.name: {t.label: tokens_to_reach(c, t.ppl, method, stay) for t in targets} for c in curves}
    ratios = {}
    for base in baselines:
        if base not in by_name:
            continue
        ratios[f"vs_{base}"] = {
            c.name: {t.label: ratio(c, reached[c.name][t.label], by_name[base], reached[base][t.label])
                     for t in targets}
            for c in curves if c.name != base
        }
    return {
        "teacher_ppl": teacher, "method": method, "stay": stay,
        "targets": [{"label": t.label, "ppl": t.ppl} for t in targets],
        "runs": [{"name": c.name, "source": c.source, "zero_shot_ppl": c.zero_shot_ppl, "final_ppl": c.final_ppl,
                  "final_kl": c.kl[-1] if c.kl else None, "final_tokens": c.final_tokens,
                  "tokens": reached[c.name], "meta": c.meta} for c in curves],
        "ratios": ratios,
    }
