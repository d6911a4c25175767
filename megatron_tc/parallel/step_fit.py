"""The fit of the step model's constants (`step_model.Fitted`) to measured steps, and the model
column of docs/results/step_model.json.

    python -m megatron_tc.parallel.step_fit            # fit the 'fit' points, print every point
    python -m megatron_tc.parallel.step_fit --write    # recompute the file's model column

Minimax relative error: the constants that make the largest |model / measured - 1| over the
fitted points smallest, ties (a constant only one point determines) broken by the smallest sum
of errors, so such a point is met exactly, and then by the lowest eager efficiency (when no eager
point is bound by its device work, the data only bound it from below: the fit takes that bound).
Given which side of `max(device, fixed)` each point is on, the step is linear in (1 / eager and
1 / compiled efficiency, ms per 10^9 parameters, eager and compiled ms per layer), so each
assignment of sides is a linear program; the fit is the best over all of them.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_tc.parallel import step_model as sm

if TYPE_CHECKING:
    from megatron_tc.parallel.memory_plan import PlanInput

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "step_model.json"
_UNIT = sm.Fitted(1.0, 1.0, 1.0, 1.0, 1.0)
_VARS = 6  # x, xc (1 / efficiency, eager and compiled), P, L, Lc, t; then one error per point


def point_plan(point: dict[str, Any]) -> "PlanInput":
    """The PlanInput of one measured point of step_model.json (a quarter-attention student)."""
    from megatron_tc.bench import models
    from megatron_tc.parallel.memory_plan import PlanInput

    arch = models.PRESETS[point["model"]]()
    return PlanInput(arch, models.quarter_pattern(arch.num_layers), micro_batch_size=point["micro_batch"],
                     seq_len=point["seq_len"], dp=point["dp"], zero_stage=point["zero_stage"],
                     activation_checkpointing=point["checkpointing"], compile=point["compile"])


def point_seconds(point: dict[str, Any], fitted: sm.Fitted = sm.FITTED) -> float:
    """The model's step time at one point under `fitted`."""
    plan = point_plan(point)
    return sm.step_seconds(sm.step_terms(plan.teacher.with_pattern(plan.student_pattern), plan.teacher, plan, fitted))


def coefficients(point: dict[str, Any]) -> dict[str, Any]:
    """One point's step in ms as max(matmul x + gdn, layers L) + billions P + rest, with x = 1 /
    efficiency and L the eager or the compiled per-layer constant (`compiled`)."""
    plan = point_plan(point)
    terms = sm.step_terms(plan.teacher.with_pattern(plan.student_pattern), plan.teacher, plan, _UNIT)
    return {"matmul": terms["matmul"] * 1e3, "gdn": terms["gdn_kernel"] * 1e3, "layers": terms["fixed"] * 1e3,
            "billions": terms["parameters"] * 1e3, "compiled": sm.compiles(plan),
            "rest": (terms["communication"] + terms["host_optimizer"]) * 1e3}


def _program(coefs: list[dict], measured: list[float], sides: tuple[int, ...], stage: tuple[float, float] | None):
    """The linear program of one assignment of sides (1: device-bound) over variables
    [x, xc, P, L, Lc, t, e_1..e_n]. stage None: minimise t; (t_max, None): minimise the sum of
    the e_i under t <= t_max; (t_max, sum_max): maximise x (the lowest eager efficiency) under both."""
    n = len(coefs)
    width = _VARS + n
    rows, bounds_ub = [], []
    for i, (c, ms, device) in enumerate(zip(coefs, measured, sides)):
        inverse, layer = (1, 4) if c["compiled"] else (0, 3)
        lin, const = np.zeros(width), c["rest"]
        lin[2] = c["billions"]
        if device:
            lin[inverse], const = c["matmul"], const + c["gdn"]
        else:
            lin[layer] = c["layers"]
        for sign in (1, -1):  # sign * (model / measured - 1) <= e_i
            row = sign * lin / ms
            row[_VARS + i] = -1
            rows.append(row)
            bounds_ub.append(sign * (1 - const / ms))
        side = np.zeros(width)  # the side's max: device >= fixed or fixed >= device
        side[inverse], side[layer] = c["matmul"], -c["layers"]
        rows.append(-side if device else side)
        bounds_ub.append(c["gdn"] if device else -c["gdn"])
        row = np.zeros(width)  # e_i <= t
        row[_VARS + i], row[5] = 1, -1
        rows.append(row)
        bounds_ub.append(0.0)
    objective = np.zeros(width)
    t_max = None
    if stage is None:
        objective[5] = 1
    elif stage[1] is None:
        t_max, objective[_VARS:] = stage[0], 1
    else:
        t_max, objective[0] = stage[0], -1
        row = np.zeros(width)  # sum of e_i <= sum_max
        row[_VARS:] = 1
        rows.append(row)
        bounds_ub.append(stage[1])
    bounds = [(1, None), (1, None), (0, None), (0, None), (0, None), (0, t_max)] + [(0, None)] * n
    return objective, np.array(rows), np.array(bounds_ub), bounds


def _best(coefs: list[dict], measured: list[float], stage: tuple[float, float] | None):
    """The best solution over every assignment of sides (scipy's linprog)."""
    from scipy.optimize import linprog

    best = None
    for sides in itertools.product((0, 1), repeat=len(coefs)):
        objective, a_ub, b_ub, bounds = _program(coefs, measured, sides, stage)
        res = linprog(objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds)
        if res.status == 0 and (best is None or res.fun < best.fun):
            best = res
    return best


def fit(points: list[dict[str, Any]]) -> tuple[sm.Fitted, float]:
    """The minimax constants for `points` (each with measured_ms) and their largest relative error."""
    coefs, measured = [coefficients(p) for p in points], [p["measured_ms"] for p in points]
    largest = _best(coefs, measured, None).fun
    t_max = largest * (1 + 1e-9) + 1e-12
    total = _best(coefs, measured, (t_max, None)).fun
    x = _best(coefs, measured, (t_max, total * (1 + 1e-9) + 1e-12)).x
    return sm.Fitted(*(float(v) for v in (1 / x[0], 1 / x[1], x[2], x[3], x[4]))), float(max(x[_VARS:]))


def model_columns(point: dict[str, Any], fitted: sm.Fitted = sm.FITTED) -> tuple[str, str, float]:
    """A point's 'model' and 'model error' cells and its model value (ms, or the efficiency of
    dp ranks against one for a scaling point)."""
    if "measured_ms" in point:
        ms = point_seconds(point, fitted) * 1e3
        error = ms / point["measured_ms"] - 1
        return f"{ms:.0f}", "0.0%" if abs(error) < 5e-4 else f"{error:+.1%}", round(ms, 1)
    efficiency = point_seconds({**point, "dp": 1}, fitted) / point_seconds(point, fitted)
    points = 100 * (efficiency - point["measured_efficiency"])
    return f"{efficiency:.1%} efficiency", f"{points:+.1f} points", round(efficiency, 3)


def write_model_columns(doc: dict[str, Any], fitted: sm.Fitted = sm.FITTED) -> None:
    """Recompute the model cells of step_model.json's rows (in the order of its measurements)."""
    if len(doc["rows"]) != len(doc["measurements"]):
        raise ValueError("step_model.json: one row per measurement expected")
    for row, point in zip(doc["rows"], doc["measurements"]):
        row[-2], row[-1], value = model_columns(point, fitted)
        point["model_ms" if "measured_ms" in point else "model_efficiency"] = value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fit the step model's constants to docs/results/step_model.json")
    p.add_argument("--write", action="store_true", help="rewrite the file's model column with the shipped constants")
    args = p.parse_args(argv)
    doc = json.loads(RESULTS.read_text())
    fitted, largest = fit([q for q in doc["measurements"] if q["role"] == "fit"])
    print("fitted:", ", ".join(f"{k} {v:.4g}" for k, v in fitted._asdict().items()), f"(largest error {largest:.2%})")
    print("shipped:", ", ".join(f"{k} {v:.4g}" for k, v in sm.FITTED._asdict().items()))
    for point in doc["measurements"]:
        print(f"  {point['label']} ({point['role']}):", *model_columns(point)[:2])
    if args.write:
        write_model_columns(doc)
        RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
