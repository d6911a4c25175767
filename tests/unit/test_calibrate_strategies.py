"""Each strategy sets what docs/method.md says it sets; alignment and policies behave."""
import math
from dataclasses import replace

import pytest
import torch

from megatron_tc.calibrate.align import collect_layer_io, relative_mse
from megatron_tc.calibrate.policies import readout_gap, uniform
from megatron_tc.calibrate.strategies import (
    AlignSettings, LayerContext, StrategyError, TaylorFit, default_gdn_state, get_strategy,
)
from megatron_tc.calibrate.strategy_fit import candidate_prefix
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


def test_taylor_decay_and_write_strength_rules_by_hand(setup):
    """The authors' rules on numbers worked out by hand, then on the tiny teacher's statistics."""
    from megatron_tc.calibrate.strategy_paper import (
        paper_b_proj, paper_decay_rate, paper_value_scale, paper_write_strength, softplus_inverse,
    )

    # entropies 1, 2, 3: concentration 1, 0.5, 0 -> beta* 0.7, 0.5, 0.3; equal entropies: all 0.7
    torch.testing.assert_close(paper_write_strength(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)),
                               torch.tensor([0.7, 0.5, 0.3], dtype=torch.float64))
    torch.testing.assert_close(paper_write_strength(torch.tensor([2.0, 2.0])), torch.tensor([0.7, 0.7]))
    # rate ln2 / distance, clamped to [1e-3, 5]
    torch.testing.assert_close(paper_decay_rate(torch.tensor([0.5, 2.0, 1e4])),
                               torch.tensor([2 * math.log(2), math.log(2) / 2, 1e-3]))
    torch.testing.assert_close(torch.nn.functional.softplus(softplus_inverse(torch.tensor([1e-3, 0.3, 5.0]))),
                               torch.tensor([1e-3, 0.3, 5.0]))
    # row [1, -3] has mean |w| 2: rescaled to mean |w| logit(0.7) / sqrt(2); beta 0.5 zeroes its row
    got = paper_b_proj(torch.tensor([[1.0, -3.0], [2.0, 2.0]]), torch.tensor([0.7, 0.5]))
    c = math.log(0.7 / 0.3) / math.sqrt(2)
    torch.testing.assert_close(got, torch.tensor([[c / 2, -3 * c / 2], [0.0, 0.0]], dtype=torch.float64))
    # OLS of the read without the query scale: ry sqrt(d) / (rr d), clamped to [0.1, 10]
    torch.testing.assert_close(paper_value_scale(torch.tensor([8.0, 1e-3, 1e3]), torch.tensor([1.0, 1.0, 1.0]), 4),
                               torch.tensor([4.0, 0.1, 10.0]))

    stats = setup[1]
    student = _student(setup, "taylor")
    for layer in CONVERTED:
        mixer, sums = student.layers[layer].mixer, stats.layer(layer)
        default = default_gdn_state(student.arch, layer)
        torch.testing.assert_close(mixer.a_proj.weight, default["a_proj.weight"], rtol=0, atol=0)  # left at init
        assert torch.count_nonzero(mixer.A_log) == 0 and torch.count_nonzero(mixer.b_proj.bias) == 0
        distance = ((sums["dist"] + 0.5 * sums["self"]) / sums["count"]).clamp_min(0.5)
        rate = (math.log(2) / distance).clamp(1e-3, 5.0)
        torch.testing.assert_close(torch.nn.functional.softplus(mixer.dt_bias.double()), rate, rtol=1e-5, atol=0)
        entropy = sums["entropy"] / sums["count"]
        beta = 0.3 + 0.4 * (1 - (entropy - entropy.min()) / (entropy.max() - entropy.min()).clamp_min(1e-3))
        w = default["b_proj.weight"].double()
        want = torch.log(beta / (1 - beta))[:, None] / math.sqrt(32) * w / w.abs().mean(1, keepdim=True)
        torch.testing.assert_close(mixer.b_proj.weight.double(), want, rtol=1e-5, atol=1e-7)


def _silu_l2(x):
    return torch.nn.functional.normalize(torch.nn.functional.silu(x), dim=-1)


def _raw_read_step_by_step(mixer, x, doc_ids):
    """The recurrence as the authors' `_gdn_recurrence` writes it: SiLU q/k/v, L2-normalized q/k,
    no query scale, S = a (S - b S k k^T) + b v k^T, o = S q; state reset at document starts.
    x [T, hidden] -> o [T, H, D] (float64)."""
    h, d = mixer.num_heads, mixer.head_dim
    x = x.double()
    q = _silu_l2((x @ mixer.q_proj.weight.double().T).view(-1, h, d))
    k = _silu_l2((x @ mixer.k_proj.weight.double().T).view(-1, h, d))
    v = torch.nn.functional.silu(x @ mixer.v_proj.weight.double().T).view(-1, h, d)
    beta = torch.sigmoid(x @ mixer.b_proj.weight.double().T + mixer.b_proj.bias.double())
    g = -mixer.A_log.double().exp() * torch.nn.functional.softplus(x @ mixer.a_proj.weight.double().T + mixer.dt_bias.double())
    state, out = torch.zeros(h, d, d, dtype=torch.float64), []
    for t in range(x.shape[0]):
        if t > 0 and doc_ids[t] != doc_ids[t - 1]:
            state = torch.zeros_like(state)
        kk = k[t, :, :, None] @ k[t, :, None, :]
        state = g[t].exp()[:, None, None] * (state - beta[t][:, None, None] * (state @ kk)) \
            + beta[t][:, None, None] * (v[t, :, :, None] @ k[t, :, None, :])
        out.append((state @ q[t, :, :, None]).squeeze(-1))
    return torch.stack(out)


def _teacher_heads(teacher, batches, layer):
    """[(x [T, hidden], y [T, H, D], doc_ids [T])] per row: the mixer input and per-head outputs."""
    from megatron_tc.calibrate.capture import capture_layers

    rows = []

    def on_layer(index, io):
        q, k, v = io.mixer.project_qkv(io.x, io.position_ids)
        idx = torch.arange(io.x.shape[1])
        y = io.mixer.attend(q, k, v, idx, idx, io.doc_ids)
        rows.append((io.x[0].float(), y[0].transpose(0, 1).double(), io.doc_ids[0]))

    for batch in batches:
        capture_layers(teacher, batch["input_ids"], batch["doc_ids"], [layer], on_layer)
    return rows


@torch.no_grad()
def test_taylor_value_scale_and_output_gate_against_a_step_by_step_recurrence(setup):
    """sigma_h = OLS of the raw read (before o_norm, the authors' unscaled query) against the
    teacher's head output, clamped to [0.1, 10], folded into v_proj rows; g_proj = alpha W_v with
    alpha = 0.01 x mean per-token RMS of the head outputs / RMS of SiLU(sigma-scaled v)."""
    from megatron_tc.calibrate.strategies import Taylor

    teacher, stats, batches, _ = setup
    student = _student(setup, "taylor")
    arch = student.arch
    for layer in CONVERTED:
        ctx = LayerContext(layer, arch, {k: v.clone() for k, v in teacher.layers[layer].mixer.state_dict().items()},
                           default_gdn_state(arch, layer), stats)
        closed = type(student.layers[layer].mixer)(arch, layer)
        params = Taylor().closed_form(ctx)
        assert [k for k, v in params.items() if v.is_meta] == ["g_proj.weight"]  # set in finish: never drawn
        closed.load_state_dict({k: v for k, v in params.items() if not v.is_meta}, strict=False)
        num = den = 0
        rms_sum, silu_sq, tokens = 0.0, 0.0, 0
        rows = _teacher_heads(teacher, batches, layer)
        for x, y, doc in rows:
            o = _raw_read_step_by_step(closed, x, doc)
            num, den = num + (o * y).sum(dim=(0, 2)), den + o.pow(2).sum(dim=(0, 2))
            rms_sum += float(y.pow(2).mean(-1).sqrt().sum())
            tokens += x.shape[0]
        sigma = (num / den).clamp(0.1, 10.0)
        mixer = student.layers[layer].mixer
        v = ctx.teacher["v_proj.weight"].view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1).double()
        torch.testing.assert_close(mixer.v_proj.weight.double(), v * sigma.repeat_interleave(8)[:, None], rtol=1e-4, atol=1e-7)
        for x, _, _ in rows:
            silu_sq += float(torch.nn.functional.silu(x.double() @ mixer.v_proj.weight.double().T).pow(2).sum())
        alpha = 0.01 * (rms_sum / (tokens * 4)) / math.sqrt(silu_sq / (tokens * 32))
        torch.testing.assert_close(mixer.g_proj.weight.double(), alpha * mixer.v_proj.weight.double(), rtol=2e-3, atol=0)


def test_value_grid_interpolation_is_close_to_the_direct_sum():
    from megatron_tc.calibrate.readout import VALUE_SCALE_GRID, interpolate_value_grid

    torch.manual_seed(0)
    v = torch.randn(3, 500, dtype=torch.float64) * torch.tensor([[0.3], [1.0], [4.0]], dtype=torch.float64)
    silu_sq = lambda c: torch.nn.functional.silu(c * v).pow(2).sum(-1)  # noqa: E731
    grid = torch.stack([silu_sq(float(c)) for c in VALUE_SCALE_GRID], dim=1)
    scale = torch.tensor([0.1234, 1.7, 9.99], dtype=torch.float64)
    want = torch.stack([silu_sq(float(s))[i] for i, s in enumerate(scale)])
    torch.testing.assert_close(interpolate_value_grid(grid, scale), want, rtol=1e-3, atol=0)


@torch.no_grad()
def test_taylor_fit_sets_mean_write_strength_on_calibration_data(setup):
    stats, io = setup[1], setup[3]
    student = _student(setup, "taylor_fit")
    for layer in CONVERTED:
        mixer = student.layers[layer].mixer
        target = stats.mean(layer, "conc_nosink").clamp(0.05, 0.95)
        _, beta = mixer.gates(io[layer].x)
        measured = beta.double().mean(dim=(0, 1))
        assert float((measured - target).abs().max()) <= 1e-3
        torch.testing.assert_close(_half_life(mixer).double(), stats.mean(layer, "dist_nosink").clamp(1, 24), rtol=1e-5, atol=0)


@pytest.mark.parametrize("init,candidates", [("taylor_fit-closed", 8), ("taylor_fit-meangate", 5)])
def test_taylor_fit_fitted_readout_beats_silence_and_matches_its_sums(setup, init, candidates):
    """taylor_fit's closed form: 5 γ W_v candidates + 3 near-constant mean-input gates; the ablation without
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


def test_taylor_fit_aligns_from_the_damped_gate_with_its_own_value_scale(setup):
    """taylor_fit: its own write strength and timescale, the paper's 0.01 W_v gate, and a per-head
    OLS value scale fitted on the read-out of *that* closed form (not the paper's); the fitted gate
    is taylor_fit's closed form only, and `taylor_fit+gatefit` aligns from it."""
    teacher, stats = setup[0], setup[1]
    fit, closed = _student(setup, "taylor_fit"), _student(setup, "taylor_fit-closed")
    assert get_strategy("taylor_fit").align is not None and get_strategy("taylor_fit-closed").align is None
    assert get_strategy("taylor_fit+gatefit").readout_name == "taylor_fit-closed"
    for layer in CONVERTED:
        mixer, t = fit.layers[layer].mixer, teacher.layers[layer].mixer
        v = t.v_proj.weight.view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1)
        torch.testing.assert_close(mixer.g_proj.weight, 0.01 * v)
        readout = stats.readout("taylor_fit", layer)
        assert readout["uy"].shape[0] == 1  # one candidate: the damped gate
        alpha = (readout["uy"][0] / readout["uu"][0]).float()
        scale = mixer.o_proj.weight / t.o_proj.weight
        torch.testing.assert_close(scale, alpha.repeat_interleave(8)[None].expand_as(scale), rtol=1e-4, atol=1e-6)
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


def test_api_splits_heldout_rows_from_the_calibration_batches(setup):
    teacher, stats, batches, _ = setup
    settings = AlignSettings(steps=2, eval_every=1, best_on="heldout")
    _, report = calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches, stats=stats, teacher_sha256="t",
                                  align=settings, progress=False)
    assert report["heldout_split"] == {"calibration": 3, "heldout": 1}
    with pytest.raises(StrategyError, match="at least 2 calibration batches"):
        calibrate_student(teacher, [1], "taylor_fit", calib_batches=batches[:1], stats=stats, teacher_sha256="t",
                          align=settings, progress=False)


def test_policies(setup):
    assert uniform(28, 7).keep == [0, 4, 8, 12, 16, 20, 24]  # the authors' Qwen2.5-1.5B choice
    assert uniform(30, 8).keep == [0, 3, 6, 9, 12, 15, 18, 21]
    assert uniform(4, 1).keep == [0]


@torch.no_grad()
def test_readout_gap_scores_the_energy_the_fitted_closed_form_leaves_unexplained(setup):
    """score(l) = sum |mixer(x) - y|^2 / sum |resid|^2 with the taylor_fit-closed mixer run on the
    layer's inputs (the policy gets it from the readout sums alone); the highest score is kept."""
    teacher, stats, batches, io = setup
    student = _student(setup, "taylor_fit-closed")
    resid = collect_layer_io(teacher, batches, list(CONVERTED), keep_resid=True)
    direct = {}
    for layer in CONVERTED:
        data = io[layer]
        out = student.layers[layer].mixer(data.x, doc_ids=data.doc_ids)
        direct[layer] = float((out - data.y).double().pow(2).sum() / resid[layer].resid.double().pow(2).sum())
    sel = readout_gap(stats, 1)
    assert sorted(sel.scores) == sorted(direct)
    for layer in CONVERTED:  # the readout sums accumulate U.U in fp32 per batch
        assert sel.scores[layer] == pytest.approx(direct[layer], rel=1e-3)
    assert sel.keep == [max(direct, key=direct.get)]
    assert abs(direct[0] - direct[2]) > 0.05 * max(direct.values())  # a choice the scores decide


def test_ar_bypasses_one_layers_attention_in_the_teacher(setup):
    """score(l) = ppl(teacher with layer l's attention output zeroed) - ppl(teacher), whatever the init."""
    import copy

    from megatron_tc.calibrate.policies import attention_removal, perplexity

    teacher, _, batches, _ = setup
    sel = attention_removal(teacher, 1, batches)
    base = perplexity(teacher, batches)
    for layer in range(3):
        silent = copy.deepcopy(teacher)
        torch.nn.init.zeros_(silent.layers[layer].mixer.o_proj.weight)  # the mixer now outputs zeros
        assert sel.scores[layer] == pytest.approx(perplexity(silent, batches) - base, rel=1e-6)
    assert sel.keep == [max(sel.scores, key=sel.scores.get)] and sel.details["init"] == "bypass"
    assert perplexity(teacher, batches) == base  # the hook is gone


def test_ga_ranks_one_layer_kept_students_by_perplexity(setup):
    from megatron_tc.calibrate.policies import greedy_addition, perplexity
    from megatron_tc.calibrate.strategies import PAPER_GA_ALIGN

    teacher, stats, batches, _ = setup
    assert PAPER_GA_ALIGN.lr_gates == 3e-3 and PAPER_GA_ALIGN.lr_proj == 1e-4  # scripts/greedy_layer_selection.py
    stats3 = stats_of_all_layers()
    sel = greedy_addition(teacher, 2, batches, init="taylor", stats=stats3, teacher_sha256="t")
    for layer in range(3):
        student = build_student(teacher, "".join("A" if i == layer else "G" for i in range(3)), "taylor", stats3, teacher_sha256="t")
        assert sel.scores[layer] == pytest.approx(-perplexity(student, batches), rel=1e-6)
    assert sel.keep == sorted(sorted(range(3), key=lambda l: -sel.scores[l])[:2])


def stats_of_all_layers():
    from megatron_tc.calibrate.stats import collect_stats

    teacher, ids, doc_ids = tiny_teacher_and_rows()
    batches = [{"input_ids": ids[r:r + 1], "doc_ids": doc_ids[r:r + 1]} for r in range(4)]
    return collect_stats(teacher, batches, [0, 1, 2], {"teacher_sha256": "t", "seq_len": 24},
                         readout_strategies=[get_strategy("taylor")], student_arch=teacher.arch.with_pattern("GGG"),
                         chunk_size=5, progress=False)


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


def _authors_alignment_loop(mixer, data, steps, lr_new=1e-3, lr_qkv=1e-4):
    """`apply_taylor_calibrate`'s phase 2 written out plainly: bf16 layer, AdamW (default betas,
    weight decay 0.01) with q/k/v weights at lr_qkv and every other parameter but o_proj / o_norm at
    lr_new, absolute MSE on every row each step, gradient norm 1; the state after the update of the
    step whose (pre-update) loss was lowest is kept."""
    import copy

    layer = copy.deepcopy(mixer).to(torch.bfloat16)
    qkv = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]
    new = [p for n, p in layer.named_parameters() if not any(p is q for q in qkv) and "o_proj" not in n and "o_norm" not in n]
    for p in layer.parameters():
        p.requires_grad_(False)
    for p in qkv + new:
        p.requires_grad_(True)
    opt = torch.optim.AdamW([{"params": qkv, "lr": lr_qkv}, {"params": new, "lr": lr_new}], weight_decay=0.01)
    x, target = data.x.to(torch.bfloat16), data.y.to(torch.bfloat16).float()
    best, state = math.inf, None
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x, doc_ids=data.doc_ids).float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(qkv + new, 1.0)
        opt.step()
        if loss.item() < best:
            best, state = loss.item(), {n: p.detach().clone() for n, p in layer.named_parameters()}
    return best, state


def test_taylor_calibrate_alignment_is_the_authors_loop(setup):
    from megatron_tc.calibrate.align import align_layer

    settings = get_strategy("taylor_calibrate").align
    assert (settings.lr_gates, settings.lr_proj, settings.weight_decay, settings.batch_rows) == (1e-3, 1e-4, 0.01, 0)
    io = setup[3]
    student = _student(setup, "taylor")
    for layer in CONVERTED:
        mixer = student.layers[layer].mixer
        o_proj, o_norm = mixer.o_proj.weight.clone(), mixer.o_norm.weight.clone()
        want_loss, want = _authors_alignment_loop(mixer, io[layer], steps=4)
        report = align_layer(mixer, io[layer], replace(settings, steps=4))
        assert report["best"] == pytest.approx(want_loss, rel=1e-6)
        for name, param in mixer.named_parameters():
            assert param.dtype == torch.float32 and param.requires_grad
            torch.testing.assert_close(param.detach(), want[name].float(), rtol=0, atol=0, msg=name)
        # frozen (rounded to bf16 once: the authors' student is a bf16 model)
        torch.testing.assert_close(mixer.o_proj.weight, o_proj.bfloat16().float(), rtol=0, atol=0)
        torch.testing.assert_close(mixer.o_norm.weight, o_norm.bfloat16().float(), rtol=0, atol=0)


def test_ga_probes_are_aligned_taylor_calibrate_students(setup, monkeypatch):
    from megatron_tc.calibrate import strategies
    from megatron_tc.calibrate.policies import greedy_addition, perplexity

    short = replace(strategies.PAPER_GA_ALIGN, steps=3)  # the authors' 300 steps, shortened for the test
    monkeypatch.setattr(strategies, "PAPER_GA_ALIGN", short)
    teacher, _, batches, _ = setup
    stats3 = stats_of_all_layers()
    sel = greedy_addition(teacher, 1, batches, stats=stats3, teacher_sha256="t")
    assert sel.details["init"] == "taylor_calibrate"
    student, report = calibrate_student(teacher, [2], "taylor_calibrate", calib_batches=batches, stats=stats3,
                                        teacher_sha256="t", align=short, progress=False)
    assert report["align"]["0"]["steps"] == 3
    assert sel.scores[2] == pytest.approx(-perplexity(student, batches), rel=1e-6)


def test_a_placeholder_left_unset_is_an_error():
    """copy_teacher(replaced=...) leaves `meta` placeholders for the strategy to set; one left
    unset fails the layer's init with the strategy and parameter named, and its default is never drawn."""
    from dataclasses import dataclass

    from megatron_tc.calibrate.strategies import Strategy, copy_teacher
    from megatron_tc.model import ArchConfig, HybridLM

    @dataclass
    class Forgetful(Strategy):
        name: str = "forgetful"

        def closed_form(self, ctx):
            return copy_teacher(ctx, replaced=("g_proj.weight",))

    arch = ArchConfig(family="llama", vocab_size=97, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                      head_dim=8, intermediate_size=32, layer_pattern="GA")
    teacher = HybridLM(arch.with_pattern("AA"))
    default = default_gdn_state(arch, 0)
    ctx = LayerContext(0, arch, dict(teacher.layers[0].mixer.state_dict()), default)
    with pytest.raises(StrategyError, match=r"'forgetful' left \['g_proj.weight'\] of layer 0 unset"):
        Forgetful().init_layer(ctx)
    assert "g_proj.weight" not in default._values


@pytest.mark.parametrize("name", ["taylor", "taylor_calibrate", "taylor_fit"])
def test_closed_forms_of_several_layers_are_each_layers_own(setup, name):
    """The statistics pass builds a group of layers at once (`Strategy.closed_forms`): every
    parameter equals the one-layer closed form's, bit for bit."""
    teacher, stats = setup[0], setup[1]
    strategy = get_strategy(name)
    arch = teacher.arch.with_pattern(PATTERN)

    def context(layer):
        state = {k: v.detach() for k, v in teacher.layers[layer].mixer.state_dict().items()}
        return LayerContext(layer, arch, state, default_gdn_state(arch, layer), stats)

    together = strategy.closed_forms([context(layer) for layer in CONVERTED])
    for layer, params in zip(CONVERTED, together):
        alone = strategy.closed_form(context(layer))
        assert params.keys() == alone.keys()
        for key, value in alone.items():
            if value is None or value.is_meta:
                assert params[key] is None or params[key].is_meta, (layer, key)
            else:
                assert params[key].dtype == value.dtype and torch.equal(params[key], value), (layer, key)
