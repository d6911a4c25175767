"""Teacher -> zero-shot student: statistics (if needed), closed-form init, per-layer alignment.

    student, report = calibrate_student(teacher, keep=[3, 7, ...], init="taylor_fit",
                                        calib_batches=..., heldout_batches=..., teacher_sha256=...)

`keep` lists the layers that stay softmax attention; every other layer becomes a Gated DeltaNet
initialized by the strategy `init` (strategies.py). Everything but the converted mixers (embeddings,
norms, MLPs, kept attention, LM head) is copied from the teacher.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_tc.model import HybridLM

from .align import align_layers, collect_layer_io
from .sequential import align_student_forced
from .stats import collect_stats
from .statsfile import TaylorStats
from .strategies import AlignSettings, LayerContext, Strategy, StrategyError, default_gdn_state, get_strategy


def pattern_from_keep(num_layers: int, keep: Sequence[int]) -> str:
    bad = sorted(set(keep) - set(range(num_layers)))
    if bad:
        raise ValueError(f"kept layers {bad} do not exist (the teacher has {num_layers} layers, 0..{num_layers - 1})")
    return "".join("A" if i in set(keep) else "G" for i in range(num_layers))


def converted_layers(pattern: str) -> list[int]:
    return [i for i, kind in enumerate(pattern.replace("|", "")) if kind == "G"]


def build_student(
    teacher: HybridLM, pattern: str, strategy: Strategy | str, stats: TaylorStats | None = None,
    seed: int = 0, teacher_sha256: str | None = None, teacher_state: Mapping[str, torch.Tensor] | None = None,
) -> HybridLM:
    """A HybridLM with `pattern`, teacher weights everywhere, converted layers from `strategy`
    (closed form + readout fit; no alignment). Refuses stats of another teacher / other layers.
    teacher_state: the whole teacher's weights (HybridLM names, `teacher.arch`'s vocabulary
    padding), read by name; required when `teacher` is tensor-parallel (it holds only slices)."""
    strategy = get_strategy(strategy) if isinstance(strategy, str) else strategy
    kinds = teacher.arch.layer_kinds
    if set(kinds) != {"A"}:
        raise ValueError(f"the teacher must be all softmax attention, its pattern is {teacher.arch.layer_pattern!r}")
    arch = teacher.arch.with_pattern(pattern)
    converted = converted_layers(pattern)
    if stats is not None:
        stats.check_applies_to(teacher_sha256, converted)
    device = next(teacher.parameters()).device
    with torch.device("meta"):  # every weight is set below (teacher copy or strategy): no init
        student = HybridLM(arch)
    student = student.to_empty(device=device)  # fp32 on the teacher's device
    state = student.state_dict()
    if teacher_state is None:
        if getattr(teacher, "tp_size", 1) > 1:
            raise ValueError("build_student: a tensor-parallel teacher holds only its slices; pass teacher_state "
                             "(calibrate.teacher_io.whole_teacher_state) for the whole weights")
        teacher_state = teacher.state_dict()
    for name in state:
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "mixer" and int(parts[1]) in converted:
            continue
        state[name] = teacher_state[name].clone()
    for index in converted:
        prefix = f"layers.{index}.mixer."
        # strategies are small CPU math on the mixer's weights (see LayerContext)
        teacher_mixer = {k[len(prefix):]: teacher_state[k].detach().cpu() for k in teacher_state if k.startswith(prefix)}
        ctx = LayerContext(index, arch, teacher_mixer, default_gdn_state(arch, index, seed), stats)
        params = strategy.init_layer(ctx)
        missing = sorted(set(k[len(prefix):] for k in state if k.startswith(prefix)) - set(params))
        if missing:
            raise StrategyError(f"strategy {strategy.name!r} left {missing} of layer {index} unset")
        for key, value in params.items():
            state[prefix + key] = value.to(state[prefix + key].dtype)
    student.load_state_dict(state)
    return student.eval()


def split_heldout(calib_batches: Sequence[dict] | None, name: str) -> tuple[list[dict], list[dict]]:
    """(first three quarters, last quarter, at least one batch) of the calibration batches: the
    held-out rows a strategy picks its best alignment step on when the caller gives none."""
    batches = list(calib_batches or [])
    if len(batches) < 2:
        raise StrategyError(f"{name} keeps its best alignment step on held-out calibration rows: pass heldout_batches, "
                            f"or at least 2 calibration batches to split them from (got {len(batches)})")
    cut = len(batches) - max(1, len(batches) // 4)
    return batches[:cut], batches[cut:]


def calibrate_student(
    teacher: HybridLM,
    keep: Sequence[int],
    init: str | Strategy,
    *,
    calib_batches: Sequence[dict] | None = None,
    heldout_batches: Sequence[dict] | None = None,
    stats: TaylorStats | None = None,
    teacher_sha256: str | None = None,
    align: AlignSettings | None | bool = True,
    dp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    teacher_state: Mapping[str, torch.Tensor] | None = None,
    align_group: dist.ProcessGroup | None | str = "dp",
    writer=None,
    progress: bool = True,
    seed: int = 0,
    meta: dict | None = None,
) -> tuple[HybridLM, dict]:
    """The whole zero-shot pipeline for one retained-layer choice.

    calib_batches: this rank's calibration batches (dicts with input_ids [B, T], optional doc_ids);
    used for statistics (when `stats` is None and the strategy needs them) and alignment.
    heldout_batches: calibration-split batches the optimizer never sees (best-step selection); when
    the strategy needs them and none are given, the last quarter of calib_batches (split_heldout).
    align: True = the strategy's own settings (None for naive/zero_gate/taylor), False = skip,
    or explicit AlignSettings. tp_group / teacher_state: the teacher is tensor-parallel over
    tp_group (statistics gather its heads; alignment targets are whole layer outputs on every
    rank) and teacher_state reads its whole weights for the student (`build_student`).
    align_group: the ranks the converted layers are dealt over for alignment ("dp": dp_group);
    every one of them must hold every calibration row and the same teacher outputs.
    Returns (student, report)."""
    strategy = get_strategy(init) if isinstance(init, str) else init
    strategy.check_stats(stats)
    pattern = pattern_from_keep(teacher.arch.num_layers, keep)
    converted = converted_layers(pattern)
    report: dict = {"init": strategy.name, "pattern": pattern, "keep": sorted(keep)}
    settings = strategy.align if align is True else (align or None)
    if settings is not None and converted and settings.best_on == "heldout" and not heldout_batches:
        calib_batches, heldout_batches = split_heldout(calib_batches, strategy.name)
        report["heldout_split"] = {"calibration": len(calib_batches), "heldout": len(heldout_batches)}
    started = time.time()
    needs_stats = strategy.name not in ("naive", "zero_gate")
    if stats is None and needs_stats:
        if not calib_batches:
            raise StrategyError(f"init {strategy.name!r} needs calibration batches or a stats file")
        stats = collect_stats(
            teacher, calib_batches, converted, dict(meta or {}, teacher_sha256=teacher_sha256),
            readout_strategies=[strategy], student_arch=teacher.arch.with_pattern(pattern), seed=seed,
            dp_group=dp_group, tp_group=tp_group, progress=progress,
        )
        report["stats_seconds"] = round(time.time() - started, 1)
    student = build_student(teacher, pattern, strategy, stats, seed, teacher_sha256, teacher_state)
    align_group = dp_group if align_group == "dp" else align_group
    if settings is not None and converted:
        if not calib_batches:
            raise StrategyError(f"alignment of {strategy.name!r} needs calibration batches")
        t0 = time.time()
        if settings.best_on == "heldout" and not heldout_batches:
            raise StrategyError(f"{strategy.name} keeps the best step on held-out calibration tokens: pass heldout_batches")
        if settings.forcing == "teacher":
            data = collect_layer_io(teacher, calib_batches, converted)
            held = collect_layer_io(teacher, heldout_batches, converted) if heldout_batches else None
            mixers = {l: student.layers[l].mixer for l in converted}
            layer_reports = align_layers(mixers, data, settings, held, align_group, writer, progress, seed)
        else:
            layer_reports = align_student_forced(student, teacher, converted, settings, calib_batches, heldout_batches,
                                                 align_group, writer, progress, seed)
        report["align"] = {str(l): {k: v for k, v in r.items() if k != "curve"} for l, r in sorted(layer_reports.items())}
        report["align_seconds"] = round(time.time() - t0, 1)
        report["align_forcing"] = settings.forcing
        report["align_tokens"] = sum(int(b["input_ids"].numel()) for b in calib_batches)
    report["seconds"] = round(time.time() - started, 1)
    return student.eval(), report
