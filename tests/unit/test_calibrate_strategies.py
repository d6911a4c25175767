"""Each strategy sets what docs/method.md says it sets; alignment and policies behave."""
import math

import pytest
import torch

from megatron_tc.calibrate.align import collect_layer_io, relative_mse
from megatron_tc.calibrate.policies import readout_gap, uniform
from megatron_tc.calibrate.strategies import (
    AlignSettings, LayerContext, StrategyError, TaylorFit, candidate_prefix, default_gdn_state, get_strategy,
)
from megatron_tc.calibrate.student import build_student, calibrate_student
from tests.parallel._workers_stats import stats_of_rows, tiny_teacher_and_rows

PATTERN = "GAG"
CONVERTED = (0, 2)


@pytest.fixture(scope="module")
def setup():
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    stats = stats_of_rows(range(4))
    batches = [{"input_ids": ids[r:r + 1], "doc_ids": doc_ids[r:r + 1]} for r in range(4)]
    io = collect_layer_io(teacher, batches, list(CONVERTED))
    return teacher, stats, batches, io


def _student(setup, init):
    teacher, stats, _, _ = setup
    return build_student(teacher, PATTERN, init, stats, teacher_sha256="t")


def test_naive_copies_projections_gqa_expanded_and_keeps_defaults(setup):
    teacher = setup[0]
    student = _student(setup, "naive")
    arch = student.arch
    for layer in CONVERTED:
        t, s = teacher.layers[layer].mixer, student.layers[layer].mixer
        torch.testing.assert_close(s.q_proj.weight, t.q_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(s.o_proj.weight, t.o_proj.weight, rtol=0, atol=0)
        kv = t.k_proj.weight.view(arch.num_kv_heads, arch.head_dim, -1)
        for h in range(arch.num_heads):  # query head h reads KV head h // group
            got = s.k_proj.weight.view(arch.num_heads, arch.head_dim, -1)[h]
            torch.testing.assert_close(got, kv[h // (arch.num_heads // arch.num_kv_heads)], rtol=0, atol=0)
        default = default_gdn_state(arch, layer)
        for name in ("a_proj.weight", "b_proj.weight", "A_log", "dt_bias", "g_proj.weight"):
            torch.testing.assert_close(s.state_dict()[name], default[name], rtol=0, atol=0)
    # everything that is not a converted mixer is the teacher's
    torch.testing.assert_close(student.layers[1].mixer.q_proj.weight, teacher.layers[1].mixer.q_proj.weight)
    torch.testing.assert_close(student.layers[2].mlp.up_proj.weight, teacher.layers[2].mlp.up_proj.weight)


def test_zero_gate_layers_are_silent(setup):
    student = _student(setup, "zero_gate")
    io = setup[3]
    for layer in CONVERTED:
        assert torch.count_nonzero(student.layers[layer].mixer.g_proj.weight) == 0
        out = student.layers[layer].mixer(io[layer].x, doc_ids=io[layer].doc_ids)
        assert torch.count_nonzero(out) == 0


def _half_life(mixer):
    g = -mixer.A_log.exp() * torch.nn.functional.softplus(mixer.dt_bias)  # a_proj = 0
    return -math.log(2) / g


def test_taylor_half_life_is_mean_attention_distance_and_value_scale_is_ols(setup):
    teacher, stats = setup[0], setup[1]
    student = _student(setup, "taylor")
    for layer in CONVERTED:
        mixer = student.layers[layer].mixer
        assert torch.count_nonzero(mixer.a_proj.weight) == 0
        want = stats.mean(layer, "dist").clamp(1.0, 24.0)
        torch.testing.assert_close(_half_life(mixer).double(), want, rtol=1e-5, atol=0)
        v = teacher.layers[layer].mixer.v_proj.weight.view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1)
        torch.testing.assert_close(mixer.g_proj.weight, 0.01 * v)
        readout = stats.readout("taylor", layer)
        alpha = (readout["uy"][0] / readout["uu"][0]).float()
        scale = mixer.o_proj.weight / teacher.layers[layer].mixer.o_proj.weight
        torch.testing.assert_close(scale, alpha.repeat_interleave(8)[None].expand_as(scale), rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_ours_sets_mean_write_strength_on_calibration_data(setup):
    stats, io = setup[1], setup[3]
    student = _student(setup, "taylor_fit")
    for layer in CONVERTED:
        mixer = student.layers[layer].mixer
        target = stats.mean(layer, "conc_nosink").clamp(0.05, 0.95)
        _, beta = mixer.gates(io[layer].x)
        measured = beta.double().mean(dim=(0, 1))
        assert float((measured - target).abs().max()) <= 1e-3
        torch.testing.assert_close(_half_life(mixer).double(), stats.mean(layer, "dist_nosink").clamp(1, 24), rtol=1e-5, atol=0)
    # the paper's rescaled, bias-free b_proj does not land on its target on the same data
    paper = _student(setup, "taylor")
    for layer in CONVERTED:
        target = stats.mean(layer, "conc").clamp(0.05, 0.95)
        _, beta = paper.layers[layer].mixer.gates(io[layer].x)
        assert float((beta.double().mean(dim=(0, 1)) - target).abs().max()) > 1e-3


@pytest.mark.parametrize("init,candidates", [("taylor_fit-closed", 8), ("taylor_fit-meangate", 5)])
def test_ours_fitted_readout_beats_silence_and_matches_its_sums(setup, init, candidates):
    """ours' closed form: 5 γ W_v candidates + 3 near-constant mean-input gates; the ablation without
    the mean gates reuses the first 5 candidates' sums."""
    stats, io = setup[1], setup[3]
    student = _student(setup, init)
    for layer in CONVERTED:
        mse = relative_mse(student.layers[layer].mixer, io[layer])
        readout = candidate_prefix(stats.readout("taylor_fit-closed", layer), candidates, 4)
        explained = readout["uy"].pow(2) / readout["uu"]
        assert explained.shape[0] == candidates
        index = explained.argmax(0) * 4 + torch.arange(4)
        from megatron_tc.calibrate.readout import solve_joint_scales

        alpha = solve_joint_scales(readout["G"][index][:, index], readout["r"][index])
        predicted = 1 - float(readout["r"][index] @ alpha) / float(readout["YY"])
        assert mse < 1.0  # zero_gate's relative MSE is exactly 1
        assert abs(mse - predicted) < 5e-4  # the readout sums accumulate U·U in fp32 per batch


def test_registry_and_errors(setup):
    with pytest.raises(StrategyError, match="unknown init strategy 'nope'"):
        get_strategy("nope")
    teacher, stats = setup[0], setup[1]
    arch = teacher.arch.with_pattern(PATTERN)
    no_bias = arch.__class__(**{**arch.to_dict(), "gdn_b_bias": False})
    ctx = LayerContext(0, no_bias, dict(teacher.layers[0].mixer.state_dict()), default_gdn_state(no_bias, 0), stats)
    with pytest.raises(StrategyError, match="gdn_b_bias"):
        TaylorFit().init_layer(ctx)
    with pytest.raises(StrategyError, match="needs Taylor statistics"):
        build_student(teacher, PATTERN, "taylor", None)


def test_ours_aligns_from_the_damped_gate_with_its_own_value_scale(setup):
    """taylor_fit: ours' write strength and timescale, the paper's 0.01 W_v gate, and a per-head
    OLS value scale fitted on the read-out of *that* closed form (not the paper's); the fitted gate
    is ours' closed form only, and `taylor_fit+gatefit` aligns from it."""
    teacher, stats = setup[0], setup[1]
    ours, closed = _student(setup, "taylor_fit"), _student(setup, "taylor_fit-closed")
    assert get_strategy("taylor_fit").align is not None and get_strategy("taylor_fit-closed").align is None
    assert get_strategy("taylor_fit+gatefit").readout_name == "taylor_fit-closed"
    for layer in CONVERTED:
        mixer, t = ours.layers[layer].mixer, teacher.layers[layer].mixer
        v = t.v_proj.weight.view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1)
        torch.testing.assert_close(mixer.g_proj.weight, 0.01 * v)
        readout = stats.readout("taylor_fit", layer)
        assert readout["uy"].shape[0] == 1  # one candidate: the damped gate
        alpha = (readout["uy"][0] / readout["uu"][0]).float()
        scale = mixer.o_proj.weight / t.o_proj.weight
        torch.testing.assert_close(scale, alpha.repeat_interleave(8)[None].expand_as(scale), rtol=1e-4, atol=1e-6)
        assert not torch.equal(alpha, (stats.readout("taylor", layer)["uy"][0] / stats.readout("taylor", layer)["uu"][0]).float())
        assert not torch.equal(closed.layers[layer].mixer.g_proj.weight, mixer.g_proj.weight)
        for name in ("b_proj.bias", "A_log", "dt_bias"):  # the same write strength and timescale
            torch.testing.assert_close(mixer.state_dict()[name], closed.layers[layer].mixer.state_dict()[name])


def test_alignment_keeps_best_heldout_step(setup):
    teacher, stats, batches, _ = setup
    settings = AlignSettings(steps=6, lr_gates=1e-2, lr_proj=1e-3, eval_every=2, best_on="heldout")
    student, report = calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches[:3], heldout_batches=batches[3:],
                                        stats=stats, teacher_sha256="t", align=settings, progress=False)
    held = collect_layer_io(teacher, batches[3:], list(CONVERTED))
    for layer in CONVERTED:
        r = report["align"][str(layer)]
        assert r["best"] <= r["initial"]
        assert abs(relative_mse(student.layers[layer].mixer, held[layer]) - r["best"]) < 1e-5


def test_policies(setup):
    assert uniform(30, 8).keep == [3, 7, 10, 14, 18, 21, 25, 29]
    assert uniform(4, 1).keep == [3]
    sel = readout_gap(setup[1], 1)
    assert len(sel.keep) == 1 and sel.scores[sel.keep[0]] == max(sel.scores.values())


@pytest.mark.parametrize("lr_gates", [3e-2, 3.0])
def test_train_criterion_keeps_the_parameters_whose_loss_it_recorded(setup, lr_gates):
    """best_on='train': the loss of a step is measured before the optimizer step, so the kept
    parameters must be the ones that loss was measured on (not those after the step). With one
    training row (every minibatch is that row) the recorded best is exactly reproducible."""
    from megatron_tc.calibrate.align import align_layer

    io = setup[3]
    student = _student(setup, "taylor")
    settings = AlignSettings(steps=5, lr_gates=lr_gates, lr_proj=1e-2, batch_rows=1, best_on="train")
    for layer in CONVERTED:
        mixer, row = student.layers[layer].mixer, io[layer].rows(torch.arange(1))
        report = align_layer(mixer, row, settings)
        assert report["best"] <= report["initial"]
        assert abs(relative_mse(mixer, row) - report["best"]) < 1e-5 * max(1.0, report["best"])
