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


def test_compiled_blocks_get_16_byte_aligned_tensors(monkeypatch):
    """ZeRO-3 packs parameters end to end in one buffer: a view after an odd-sized parameter starts
    off a 16-byte boundary, which inductor's kernels (compiled for aligned parameters) fault on.
    The compiled block must see an aligned copy, the eager formula's numbers, and the gradient
    must still reach the view's storage."""
    seen = []

    def recording_compile(fn, **kwargs):
        def run(*args):
            seen.append([a.data_ptr() % fz.ALIGNMENT_BYTES for a in args if isinstance(a, torch.Tensor)])
            return fn(*args)
        return run

    monkeypatch.setattr(fz, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setenv("MEGATRON_TC_COMPILE", "force")
    flat = torch.randn(1 + 9 + 9, requires_grad=True)  # fp32: the views start 4 and 40 bytes in
    a_log, dt_bias = flat[1:10], flat[10:19]
    assert a_log.data_ptr() % 16 and dt_bias.data_ptr() % 16
    a, b = torch.randn(2, 5, 9), torch.randn(2, 5, 9)
    args = (a, b, a_log, dt_bias, 8.0, -1e4)
    g, beta = fz.fused("gdn_gates", fz.gdn_gates, a)(*args)
    assert seen == [[0, 0, 0, 0]]
    want_g, want_beta = fz.gdn_gates(*args)
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)
    torch.testing.assert_close(beta, want_beta, rtol=0, atol=0)
    g.sum().backward()
    assert flat.grad is not None and flat.grad[1:10].abs().sum() > 0 and flat.grad[0] == 0
    assert fz.aligned((a, 3.0)) == (a, 3.0) and fz.aligned((a,))[0] is a  # aligned tensors are not copied
