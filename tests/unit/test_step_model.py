"""tools/plan.py's step model: each term behaves as it must, and the model reproduces the measured
stage-2 steps of docs/results/step_model.json, whose measured values must be those of the
benchmark files they come from."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_tc.bench import models
from megatron_tc.bench.models import forward_flops
from megatron_tc.parallel import memory_plan as mp
from megatron_tc.parallel import step_fit
from megatron_tc.parallel import step_model as sm

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
TOLERANCE = sm.STATED_ERROR  # relative error of the step time at every measured point, fitted or not


def plan(name: str = "llama-1b", **kw) -> mp.PlanInput:
    arch = models.PRESETS[name]()
    fields = dict(micro_batch_size=8, seq_len=2048)
    fields.update(kw)
    return mp.PlanInput(arch, models.quarter_pattern(arch.num_layers), **fields)


def terms(p: mp.PlanInput) -> dict[str, float]:
    return sm.step_terms(p.teacher.with_pattern(p.student_pattern), p.teacher, p)


def test_checkpointing_adds_one_student_forward():
    p = plan()
    plain, ckpt = terms(p), terms(dataclasses.replace(p, activation_checkpointing=True))
    student = p.teacher.with_pattern(p.student_pattern)
    tokens = p.micro_batch_size * p.seq_len
    forward = forward_flops(student, tokens, p.seq_len)
    gdn = sm.gdn_forward_flops(student, tokens, p.seq_len)
    peak = sm.MATMUL_EFFICIENCY * sm.MEASURED_PEAK_TFLOPS * 1e12
    assert ckpt["matmul"] - plain["matmul"] == pytest.approx((forward - gdn) / peak, rel=1e-9)
    assert ckpt["gdn_kernel"] - plain["gdn_kernel"] == pytest.approx(gdn / (sm.GDN_KERNEL_TFLOPS * 1e12), rel=1e-9)
    assert ckpt["fixed"] == pytest.approx(1.5 * plain["fixed"])
    assert ckpt["flops"] == plain["flops"]  # MFU counts the model's FLOPs, not the recompute


def test_zero3_gathers_scale_with_parameter_bytes_over_dp():
    p = plan()
    local = mp.parameter_counts(p.teacher.with_pattern(p.student_pattern))["total"]
    assert terms(p)["communication"] == 0.0  # one rank moves nothing over the link
    for dp in (2, 4, 8):
        got = terms(dataclasses.replace(p, dp=dp))["communication"]
        # forward gather, backward gather, gradient reduce-scatter: 3 x 2 bytes x (dp - 1) / dp
        assert got == pytest.approx(3 * 2 * local * (dp - 1) / dp / (sm.LINK_GBPS * 1e9), rel=1e-9)
    z1 = terms(dataclasses.replace(p, dp=4, zero_stage=1))["communication"]
    assert z1 == pytest.approx(terms(dataclasses.replace(p, dp=4))["communication"] / 3, rel=1e-9)
    ckpt = terms(dataclasses.replace(p, dp=4, activation_checkpointing=True))["communication"]
    assert ckpt == pytest.approx(terms(dataclasses.replace(p, dp=4))["communication"] * 4 / 3, rel=1e-9)


def test_small_models_are_bound_by_the_fixed_cost_and_large_ones_by_compute():
    small, large = terms(plan("smollm2-135m")), terms(plan("llama3-8b", micro_batch_size=8, seq_len=4096))
    assert small["fixed"] > 5 * (small["matmul"] + small["gdn_kernel"])
    assert large["matmul"] > 5 * large["fixed"]
    # the fixed cost does not grow with the batch: four times the tokens, the same step at 135M
    big_batch = sm.step_seconds(terms(plan("smollm2-135m", micro_batch_size=32)))
    assert big_batch == pytest.approx(sm.step_seconds(small), rel=0.05)
    # data parallelism divides the compute per GPU but not the fixed cost per layer
    assert terms(plan(dp=2))["fixed"] == terms(plan())["fixed"]


def _measured(doc: dict, source: str) -> float:
    """The measured step of a point, read from the benchmark file its source names."""
    name = source.split(",")[0]
    data = json.loads((RESULTS / name).read_text())
    if name == "bench_h200_train_step_1b.json":
        return next(r[1] for r in data["rows"] if r[0] == "fused")
    if name == "bench_h200_train_step_8b_shape.json":
        return data["measurements"][0]["step_ms_median"]
    if name in ("throughput_h200_train_smollm2.json", "throughput_h200_train_1b.json"):
        return next(m["step_ms_median"] for m in data["measurements"] if m["path"] == "pipeline (ZeRO-1, compiled layers)")
    raise AssertionError(f"no reader for {name}")


def test_the_model_reproduces_the_measured_steps():
    doc = json.loads((RESULTS / "step_model.json").read_text())
    points = doc["measurements"]
    assert {p["role"] for p in points} == {"fit", "check"}
    for point in points:
        p = plan(point["model"], micro_batch_size=point["micro_batch"], seq_len=point["seq_len"], dp=point["dp"],
                 zero_stage=point["zero_stage"], activation_checkpointing=point["checkpointing"],
                 compile=point["compile"])
        if "measured_ms" in point:
            if point["source"].endswith(".json") or ".json," in point["source"]:
                assert _measured(doc, point["source"]) == pytest.approx(point["measured_ms"], abs=0.05)
            got = mp.plan_memory(p)["step_s"] * 1e3
            # the plan prints the step to the millisecond
            assert abs(got - point["measured_ms"]) <= TOLERANCE * point["measured_ms"] + 0.5, (point["label"], got)
        else:  # data-parallel scaling: the efficiency of dp ranks against one
            scaling = json.loads((RESULTS / "bench_h200x2_zero3_scaling_1b.json").read_text())
            one, two = (r[2] for r in scaling["rows"] if r[1] == "5e8")
            assert point["measured_efficiency"] == pytest.approx(one / two, abs=0.001)
            model = mp.plan_memory(dataclasses.replace(p, dp=1))["step_s"] / mp.plan_memory(p)["step_s"]
            assert abs(model - point["measured_efficiency"]) <= TOLERANCE


def test_every_row_of_the_table_is_the_models_and_within_the_stated_error():
    doc = json.loads((RESULTS / "step_model.json").read_text())
    assert len(doc["rows"]) == len(doc["measurements"])
    for row, point in zip(doc["rows"], doc["measurements"]):
        measured = point.get("measured_ms", point.get("measured_efficiency"))
        assert row[4] == (f"{measured}" if "measured_ms" in point else f"{measured:.1%} efficiency")
        assert row[3] == ("fitted" if point["role"] == "fit" else "not fitted")
        assert row[5:] == list(step_fit.model_columns(point)[:2]), point["label"]
        error = float(row[6].removesuffix("%").removesuffix(" points")) / 100  # percent or points
        assert abs(error) <= sm.STATED_ERROR, (point["label"], row[6])


def test_compiled_layers_follow_parallel_compile_and_change_only_the_fixed_cost_and_matmul_rate():
    # auto compiles where stage 2 does: ZeRO-1/2, tp = pp = 1, no activation checkpointing
    assert sm.compiles(plan(zero_stage=1)) and sm.compiles(plan(zero_stage=2))
    assert not any(sm.compiles(plan(**kw)) for kw in (dict(zero_stage=3), dict(zero_stage=0),
                                                      dict(zero_stage=1, activation_checkpointing=True),
                                                      dict(zero_stage=1, compile="false")))
    eager, compiled = terms(plan(zero_stage=1, compile="false")), terms(plan(zero_stage=1))
    assert compiled["fixed"] == pytest.approx(eager["fixed"] * sm.COMPILED_LAYER_MS / sm.LAYER_MS, rel=1e-9)
    assert compiled["matmul"] == pytest.approx(eager["matmul"] * sm.MATMUL_EFFICIENCY / sm.COMPILED_MATMUL_EFFICIENCY,
                                               rel=1e-9)
    same = {k for k in eager if k not in ("fixed", "matmul")}
    assert {k: compiled[k] for k in same} == {k: eager[k] for k in same}
