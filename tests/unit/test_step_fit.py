"""The step model's fit (parallel.step_fit): it recovers known constants from steps the model
itself produced (the eager efficiency, which no eager step bound by the host determines, as the
lowest those steps allow), nothing beats its largest error, and the shipped constants are its fit
of docs/results/step_model.json."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_tc.parallel import step_fit
from megatron_tc.parallel import step_model as sm


def point(model: str, batch: int, seq: int, zero: int, compile: str = "auto", ckpt: bool = False) -> dict:
    return {"model": model, "micro_batch": batch, "seq_len": seq, "zero_stage": zero, "dp": 1,
            "checkpointing": ckpt, "compile": compile, "role": "fit", "label": model}


# each constant has a point bound by it: SmolLM2 on the host (eager and compiled), the 8B widths
# with checkpointing and more parameters per layer, the 1.1B compiled step on the device
LAYOUTS = [point("smollm2-135m", 8, 2048, 3), point("llama-1b", 8, 2048, 3),
           point("llama3-8b-8l", 1, 4096, 3, ckpt=True), point("smollm2-135m", 32, 2048, 1),
           point("llama-1b", 16, 2048, 1)]
TRUE = sm.Fitted(0.8, 0.85, 50.0, 20.0, 9.0)


def with_steps_at(layouts: list[dict], constants: sm.Fitted, scale: list[float] | None = None) -> list[dict]:
    scale = scale or [1.0] * len(layouts)
    return [{**p, "measured_ms": step_fit.point_seconds(p, constants) * 1e3 * s} for p, s in zip(layouts, scale)]


def with_steps(constants: sm.Fitted, scale: list[float]) -> list[dict]:
    return with_steps_at(LAYOUTS, constants, scale)


def largest_error(points: list[dict], constants: sm.Fitted) -> float:
    return max(abs(step_fit.point_seconds(p, constants) * 1e3 / p["measured_ms"] - 1) for p in points)


def test_the_fit_recovers_the_constants_that_produced_the_steps():
    points = with_steps(TRUE, [1.0] * len(LAYOUTS))
    sides = [step_fit.coefficients(p) for p in points]
    device = [c["matmul"] / (TRUE.compiled_matmul_efficiency if c["compiled"] else TRUE.matmul_efficiency) + c["gdn"]
              > c["layers"] * (TRUE.compiled_layer_ms if c["compiled"] else TRUE.layer_ms) for c in sides]
    assert device == [False, False, False, False, True]  # the layouts are bound where the comment says
    fitted, largest = step_fit.fit(points)
    assert np.allclose(fitted[1:], TRUE[1:], rtol=1e-6) and largest < 1e-7
    # the eager efficiency: the lowest at which every eager step stays bound by the host
    lowest = max(c["matmul"] / (c["layers"] * TRUE.layer_ms - c["gdn"]) for c in sides if not c["compiled"])
    assert fitted.matmul_efficiency == pytest.approx(lowest, rel=1e-6) and lowest < TRUE.matmul_efficiency
    # a step bound by its device work at the true efficiency pins it
    bound = point("llama3-8b-8l", 8, 4096, 3)
    assert step_fit.coefficients(bound)["matmul"] / TRUE.matmul_efficiency > step_fit.coefficients(bound)["layers"] * TRUE.layer_ms
    fitted, largest = step_fit.fit(points + with_steps_at([bound], TRUE))
    assert np.allclose(fitted, TRUE, rtol=1e-6) and largest < 1e-7


def test_no_constants_beat_the_fits_largest_error():
    # the steps off the model by up to 3%: the fit is at most that, and a search around it finds nothing better
    points = with_steps(TRUE, [1.03, 0.97, 1.03, 0.99, 1.01])
    fitted, largest = step_fit.fit(points)
    assert largest == pytest.approx(largest_error(points, fitted), rel=1e-6)
    assert largest <= largest_error(points, TRUE) + 1e-9
    coefs = [step_fit.coefficients(p) for p in points]
    measured = np.array([p["measured_ms"] for p in points])

    def errors(c: np.ndarray) -> np.ndarray:  # [samples, 5] constants (sm.Fitted's order) -> largest error of each
        ms = np.stack([np.maximum(k["matmul"] / c[:, 1 if k["compiled"] else 0] + k["gdn"],
                                  k["layers"] * c[:, 4 if k["compiled"] else 3])
                       + k["billions"] * c[:, 2] + k["rest"] for k in coefs], axis=1)
        return np.abs(ms / measured - 1).max(axis=1)

    assert errors(np.array([fitted]))[0] == pytest.approx(largest, rel=1e-9)
    rng = np.random.default_rng(0)
    samples = np.array(fitted) * (1 + rng.uniform(-0.05, 0.05, size=(20000, 5)))
    assert errors(samples).min() >= largest - 1e-12


def test_the_shipped_constants_are_the_fit_of_the_measured_steps():
    doc = json.loads(step_fit.RESULTS.read_text())
    fitted, largest = step_fit.fit([p for p in doc["measurements"] if p["role"] == "fit"])
    assert np.allclose(sm.FITTED, fitted, rtol=1e-3)
    assert largest <= sm.STATED_ERROR


def test_the_table_needs_one_row_per_measurement():
    doc = json.loads(step_fit.RESULTS.read_text())
    with pytest.raises(ValueError, match="one row per measurement"):
        step_fit.write_model_columns({**doc, "rows": doc["rows"][:-1]})
