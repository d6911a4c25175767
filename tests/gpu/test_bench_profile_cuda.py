"""The benchmarks' profile rows on CUDA (`bench.common.profile_rows`): each kernel's device time
counted once, the device's busy time against the call's wall time, and the device time a
profiled range launched, against CUDA events around the same kernels.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_bench_profile_cuda.py` (torch only).
"""
from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import record_function

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)

from megatron_tc.bench.common import profile_rows  # noqa: E402

HOST_PAUSE_S = 0.03  # the host sleeps with nothing queued: the device is idle that long


def test_profile_rows_count_kernels_once_and_see_the_device_idle():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)  # a GEMM outlasts its launch
    timed = {}

    def work():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with record_function("bench.matmuls"):
            start.record()
            for _ in range(40):
                a @ a
            end.record()
        torch.cuda.synchronize()
        timed["ms"] = start.elapsed_time(end)
        time.sleep(HOST_PAUSE_S)
        (a * 2).sum()

    rows = profile_rows(work, device, ranges="bench.")
    total, busy = rows[0], rows[1]
    assert total["op"] == "(all)" and busy["op"] == "(device busy)"
    (matmuls,) = [row for row in rows if row.get("range") == "bench.matmuls"]
    assert matmuls["calls"] == 1
    # the range's kernels ran back to back between the two events
    assert matmuls["device_ms"] == pytest.approx(timed["ms"], rel=0.25)
    # one stream, kernels one after another: their summed time is the busy time (not twice it)
    assert busy["device_ms"] == pytest.approx(total["device_ms"], rel=0.15)
    # the range's kernels are part of the busy time (their records may overlap by a few us where
    # one kernel starts as the last ends: the summed durations can pass the union by that much)
    assert matmuls["device_ms"] <= busy["device_ms"] * 1.05
    assert busy["host_ms"] >= busy["device_ms"] + 1e3 * HOST_PAUSE_S * 0.9
