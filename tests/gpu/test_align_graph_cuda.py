"""The lockstep alignment replayed from a CUDA graph == the same alignment stepped eagerly on CUDA.

Run on a GPU machine: `python -m pytest -q -s tests/gpu/test_align_graph_cuda.py` (the GDN
kernels compile once for SmolLM2's layer shape: about a minute; the benchmark then reuses them).
Two layers of SmolLM2's shape, 16 rows of 512 tokens in bf16: the authors' settings (every row
each step, best state after the update) and taylor_fit's (drawn rows gathered on the device,
held-out evals between replays). Both runs take the same first steps; the captured one then
replays a step recorded with AdamW's capturable update and the eager element-wise formulas (the
eager run: compiled blocks), so they agree to rounding, within the bounds the CPU-vs-CUDA check
of calibration uses (tests/unit/test_calibrate_device.py: initial 5e-3, best 2e-2 relative),
here also for every step's training loss. The same over rows of packed documents (doc_ids, as the
pipeline calibrates): their fla layout is precomputed (PackedRows), so these steps replay too; and
fla's kernels given PackedRows agree with fla's kernels given the doc_ids. A capture that fails
leaves the steps to eager code.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla.ops.gated_delta_rule")

from megatron_tc.bench.models import quarter_pattern, smollm2_135m  # noqa: E402
from megatron_tc.bench.stats_run import packed_batches  # noqa: E402
from megatron_tc.calibrate import align_graph  # noqa: E402
from megatron_tc.calibrate.align import AlignJob, LayerData, align_together  # noqa: E402
from megatron_tc.calibrate.strategies import TAYLOR_FIT_ALIGN, get_strategy  # noqa: E402
from megatron_tc.calibrate.student import converted_layers  # noqa: E402
from megatron_tc.model.gdn import GatedDeltaNet  # noqa: E402
from megatron_tc.model.ops.gated_delta_rule import PackedRows  # noqa: E402

STEPS = 8
SETTINGS = {
    "the authors' (all rows, after update)": replace(get_strategy("taylor_calibrate").align, steps=STEPS),
    "taylor_fit's (drawn rows, held-out evals)": replace(TAYLOR_FIT_ALIGN, steps=STEPS, eval_every=3, batch_rows=16,
                                                         dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def case():
    """Two converted layers of SmolLM2's shape; targets from other random GDN layers."""
    pattern = quarter_pattern(30)
    arch = smollm2_135m().with_pattern(pattern)
    layers = converted_layers(pattern)[:2]
    torch.manual_seed(0)
    mixers, data, held = {}, {}, {}
    for l in layers:
        mixers[l] = GatedDeltaNet(arch, l).cuda()
        teacher = GatedDeltaNet(arch, l).cuda().to(torch.bfloat16)  # bf16: the kernels alignment compiles
        x = torch.randn(32, 512, arch.hidden_size, device="cuda")
        with torch.no_grad():
            y = teacher(x.to(torch.bfloat16)).float()
        data[l], held[l] = LayerData(x[:16], y[:16], None), LayerData(x[16:20], y[16:20], None)
    return layers, mixers, data, held


def align(case, settings, graphs):
    layers, mixers, data, held = case
    mixers = copy.deepcopy(mixers)
    losses = []
    jobs = [AlignJob(mixers[l], data[l], held[l], seed=l, tag=f"L{l}") for l in layers]
    reports = align_together(jobs, settings, log=lambda tag, value, step: losses.append((tag, step, value)),
                             graphs=graphs)
    return reports, losses, mixers


def close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


@pytest.fixture(scope="module")
def packed_case():
    """`case` over rows of packed documents (doc_ids as the pipeline's calibration rows: several
    documents a row, some rows one), targets from GDN layers that reset at the boundaries."""
    pattern = quarter_pattern(30)
    arch = smollm2_135m().with_pattern(pattern)
    layers = converted_layers(pattern)[:2]
    doc_ids = torch.cat([b["doc_ids"] for b in packed_batches(8, 20, 512, 300, "cuda", seed=1)])
    doc_ids[3] = 0  # a row of one document
    torch.manual_seed(0)
    mixers, data, held = {}, {}, {}
    for l in layers:
        mixers[l] = GatedDeltaNet(arch, l).cuda()
        teacher = GatedDeltaNet(arch, l).cuda().to(torch.bfloat16)
        x = torch.randn(20, 512, arch.hidden_size, device="cuda")
        with torch.no_grad():
            y = teacher(x.to(torch.bfloat16), doc_ids=doc_ids).float()
        data[l], held[l] = LayerData(x[:16], y[:16], doc_ids[:16]), LayerData(x[16:], y[16:], doc_ids[16:])
    return layers, mixers, data, held


@pytest.mark.parametrize("name", list(SETTINGS))
def test_replayed_steps_equal_eager_steps(case, name, monkeypatch):
    check_replay(case, SETTINGS[name], monkeypatch)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_replayed_steps_with_packed_documents_equal_eager_steps(packed_case, name, monkeypatch):
    check_replay(packed_case, SETTINGS[name], monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_with_packed_rows_equals_fla_with_doc_ids(packed_case, dtype):
    """The mixer through fla's kernels: PackedRows of drawn rows (padded, chunk indices passed in)
    against the same rows' doc_ids (segments derived in the call): outputs and gradients."""
    layers, mixers, data, _ = packed_case
    mixer = copy.deepcopy(mixers[layers[0]]).to(dtype)
    rows = torch.tensor([3, 0, 7, 7], device="cuda")
    x = data[layers[0]].x[rows].to(dtype)

    def run(docs):
        mixer.zero_grad()
        out = mixer(x, doc_ids=docs)
        out.float().square().mean().backward()
        return out.float(), [p.grad.float().clone() for p in mixer.parameters()]

    want, want_grads = run(data[layers[0]].doc_ids[rows])
    got, got_grads = run(PackedRows.of(data[layers[0]].doc_ids)[rows])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **tol)


def check_replay(case, settings, monkeypatch):
    captured = []
    original = align_graph.capture_step
    monkeypatch.setattr(align_graph, "capture_step", lambda *a: captured.append(original(*a)) or captured[-1])
    want, want_losses, want_mixers = align(case, settings, graphs=False)
    assert captured == []
    got, got_losses, got_mixers = align(case, settings, graphs=True)
    assert len(captured) == 1  # one capture, replayed for steps 4..8
    assert [(t, s) for t, s, _ in got_losses] == [(t, s) for t, s, _ in want_losses]
    bad = [(t, s, g, w) for (t, s, g), (_, _, w) in zip(got_losses, want_losses) if not close(g, w, 2e-2)]
    assert not bad, bad
    train = [v for t, _, v in got_losses if t.endswith("/train")]
    assert len(train) == 2 * STEPS and min(train) > 0  # every replay wrote its own step's loss
    for g, w in zip(got, want):
        assert close(g["initial"], w["initial"], 5e-3) and close(g["best"], w["best"], 2e-2), (g, w)
        assert g["best"] < g["initial"] and g["best_step"] > 0, g  # alignment moved the layer
    for layer, mixer in got_mixers.items():
        for key, value in mixer.state_dict().items():
            assert torch.isfinite(value).all() and value.dtype == torch.float32, (layer, key)


def test_a_failed_capture_leaves_the_steps_to_eager_code(case, monkeypatch):
    settings = SETTINGS["the authors' (all rows, after update)"]

    def refuse(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    want, _, _ = align(case, settings, graphs=False)
    monkeypatch.setattr(align_graph, "capture_step", refuse)
    got, _, _ = align(case, settings, graphs=True)
    for g, w in zip(got, want):
        assert close(g["best"], w["best"], 2e-2) and g["best_step"] > 0, (g, w)
