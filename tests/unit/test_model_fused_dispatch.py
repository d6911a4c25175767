"""megatron_tc.model.fused: which function runs where (the compiled path itself is tested on CUDA
in tests/gpu/test_fused_model_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import fused as fz


def test_cpu_runs_the_eager_formula_unless_forced(monkeypatch):
    monkeypatch.setattr(fz, "_COMPILED", {})
    monkeypatch.delenv("MEGATRON_TC_COMPILE", raising=False)
    assert fz.fused("rms_norm", fz.rms_norm, torch.ones(2)) is fz.rms_norm
    monkeypatch.setenv("MEGATRON_TC_COMPILE", "0")
    assert fz.fused("rms_norm", fz.rms_norm, torch.ones(2)) is fz.rms_norm
    assert not fz._COMPILED


def test_a_failing_compile_warns_and_runs_eagerly(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no inductor here")
        return run

    monkeypatch.setattr(fz, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setenv("MEGATRON_TC_COMPILE", "force")
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    call = fz.fused("glu", fz.glu, gate)
    assert call is not fz.glu
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        got = call(gate, up, "silu")
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=0, atol=0)
    assert call(gate, up, "silu").equal(got)  # no second warning needed: eager from now on
