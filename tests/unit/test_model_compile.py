"""Stage 2's per-layer compile (`parallel.compile`): the compiled student computes what the eager
one does, and the switch resolves as docs/parallelism.md says. On CPU the layers are traced with
the "aot_eager" backend (dynamo capture and the joint forward/backward graph, run op by op):
inductor's code generation is exercised on the GPU."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megatron_tc.bench.models import tiny
from megatron_tc.config import ConfigError, apply_overrides, config_from_dict, validate_config
from megatron_tc.distill.stage2_setup import resolve_compile, resolve_teacher_compile
from megatron_tc.model import HybridLM
from megatron_tc.model.compile import compile_decoder_layers, is_compiled


def test_compiled_layers_match_the_eager_model_in_values_gradients_and_names():
    torch.manual_seed(0)
    eager = HybridLM(tiny().with_pattern("AGGA"))
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, backend="aot_eager") == 4
    assert all(is_compiled(layer) for layer in compiled.layers) and not is_compiled(eager.layers[0])
    ids = torch.randint(0, 256, (2, 32))
    doc_ids = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    for kwargs in ({}, {"doc_ids": doc_ids}):
        want, got = eager(ids, **kwargs), compiled(ids, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        want.pow(2).mean().backward()
        got.pow(2).mean().backward()
    for (name, p), (other, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert name == other
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints keep their names


def test_compiled_teacher_layers_give_the_eager_logits_without_grad():
    """The frozen teacher as stage 2 runs it: under no_grad, all attention, packed documents or not."""
    torch.manual_seed(0)
    eager = HybridLM(tiny().with_pattern("AAAA")).eval().requires_grad_(False)
    compiled = copy.deepcopy(eager)
    compile_decoder_layers(compiled, backend="aot_eager")
    ids = torch.randint(0, 256, (2, 32))
    doc_ids = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    with torch.no_grad():
        for kwargs in ({}, {"doc_ids": doc_ids}):
            torch.testing.assert_close(compiled(ids, **kwargs), eager(ids, **kwargs), rtol=1e-6, atol=1e-6)


def test_compile_needs_decoder_layers():
    with pytest.raises(ValueError, match="no `layers` to compile"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


def _cfg(*overrides: str):
    return config_from_dict(apply_overrides({"model": {"teacher": "t"}}, overrides))


CTX = SimpleNamespace(rank=0, pp_size=1, tp_size=1)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_compiles_on_cuda_without_partitioned_parameters(monkeypatch):
    monkeypatch.delenv("MEGATRON_TC_COMPILE", raising=False)
    auto = _cfg()
    assert resolve_compile(auto, CTX, CUDA, zero_stage=1) and resolve_compile(auto, CTX, CUDA, zero_stage=2)
    assert not resolve_compile(auto, CTX, CPU, zero_stage=1)
    assert not resolve_compile(auto, CTX, CUDA, zero_stage=3) and not resolve_compile(auto, CTX, CUDA, zero_stage=0)
    assert not resolve_compile(_cfg("parallel.activation_checkpointing=true"), CTX, CUDA, zero_stage=1)
    assert not resolve_compile(auto, SimpleNamespace(rank=0, pp_size=1, tp_size=2), CUDA, zero_stage=1)
    assert resolve_compile(_cfg("parallel.compile=true"), CTX, CPU, zero_stage=1)
    assert not resolve_compile(_cfg("parallel.compile=false"), CTX, CUDA, zero_stage=1)
    monkeypatch.setenv("MEGATRON_TC_COMPILE", "0")  # the model's blocks switched to eager: so are the layers
    assert not resolve_compile(auto, CTX, CUDA, zero_stage=1)


def test_compile_true_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match=r"parallel.compile=true cannot be combined with parallel.zero_stage=3"):
        resolve_compile(_cfg("parallel.compile=true"), CTX, CUDA, zero_stage=3)  # zero_stage=auto chose 3
    with pytest.raises(ConfigError, match=r"parallel.compile=true cannot be combined with parallel.pp=2"):
        validate_config(_cfg("parallel.compile=true", "parallel.pp=2", "parallel.zero_stage=1"))
    with pytest.raises(ConfigError, match="activation_checkpointing=true; set parallel.compile=auto"):
        validate_config(_cfg("parallel.compile=true", "parallel.activation_checkpointing=true"))
    validate_config(_cfg("parallel.compile=true"))


def test_fused_blocks_trace_into_the_enclosing_graph(monkeypatch):
    """Inside a compiled layer each element-wise block is its plain formula, one graph with its
    neighbours: fullgraph capture fails if the block's own compiled wrapper (with its alignment
    check on data pointers) is called instead, as it is outside a compiled region."""
    from megatron_tc.model import fused as fz
    from megatron_tc.model.norm import RMSNorm

    monkeypatch.setenv("MEGATRON_TC_COMPILE", "force")  # blocks compiled on CPU outside a graph
    monkeypatch.setattr(fz, "_COMPILED", {})
    norm, x = RMSNorm(8), torch.randn(3, 8)
    traced = torch.compile(lambda t: norm(t) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(x), fz.rms_norm(x, norm.weight, norm.eps, False) * 2, rtol=0, atol=0)
    assert not fz._COMPILED  # the block's own compiled wrapper was never built


def test_compile_work_does_not_grow_with_depth():
    """Layers of one kind share their graphs, so a deep model compiles what a shallow one does
    (the first step of a 1B-class student costs the compile of two or three graphs, not of each layer)."""
    import dataclasses

    import torch._dynamo
    from torch._dynamo.utils import counters

    captured = {}
    for pattern in ("AGGA", "AGGGAGGGAGGG"):
        torch._dynamo.reset()
        counters.clear()
        model = HybridLM(dataclasses.replace(tiny(), num_layers=len(pattern), layer_pattern=pattern))
        compile_decoder_layers(model, backend="aot_eager")
        model(torch.randint(0, 256, (2, 16))).sum().backward()
        captured[pattern] = dict(counters["stats"])
    shallow, deep = captured.values()
    assert shallow["unique_graphs"] > 0 and deep == shallow, captured


def test_teacher_compiles_with_the_student_where_it_is_one_plain_module():
    auto = _cfg()
    assert resolve_teacher_compile(auto, CTX, CUDA, student_compiled=True)
    assert not resolve_teacher_compile(auto, CTX, CUDA, student_compiled=False)
    assert not resolve_teacher_compile(_cfg("parallel.teacher_mode=engine"), CTX, CUDA, student_compiled=True)
    assert not resolve_teacher_compile(auto, SimpleNamespace(rank=0, pp_size=1, tp_size=2), CUDA, student_compiled=True)
    assert resolve_teacher_compile(_cfg("parallel.compile_teacher=true"), CTX, CPU, student_compiled=False)
    assert not resolve_teacher_compile(_cfg("parallel.compile_teacher=false"), CTX, CUDA, student_compiled=True)


def test_compile_teacher_true_where_it_cannot_run_is_an_error():
    engine = _cfg("parallel.compile_teacher=true", "parallel.teacher_mode=engine")
    with pytest.raises(ValueError, match="parallel.compile_teacher=true cannot be combined with parallel.teacher_mode"):
        resolve_teacher_compile(engine, CTX, CUDA, student_compiled=True)
    with pytest.raises(ConfigError, match="compile_teacher=true cannot be combined with parallel.teacher_mode=engine"):
        validate_config(engine)
    with pytest.raises(ConfigError, match="compile_teacher=true cannot be combined with parallel.tp=2"):
        validate_config(_cfg("parallel.compile_teacher=true", "parallel.tp=2"))
    validate_config(_cfg("parallel.compile_teacher=true", "parallel.zero_stage=3"))
