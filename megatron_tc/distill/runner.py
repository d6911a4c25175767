"""The pipeline the config's `run.stages` names: convert -> select -> stats -> init -> stage1 ->
stage2 -> eval -> export, every stage reading and writing files in the run directory.

    result = run_pipeline(cfg, force=["stage2"])

A stage whose outputs are complete for the current config (manifest fingerprint) is skipped unless
forced; a forced training stage starts over (its checkpoints are deleted), an unforced one resumes
from its latest checkpoint. Runs on every rank of the job; rank 0 decides and writes the
bookkeeping, and the decisions are broadcast so ranks never diverge.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_tc.config.names import STAGES
from megatron_tc.distill.context import RunContext, ensure_process_group_env, pick_device
from megatron_tc.distill.host_memory import keep_freed_host_memory
from megatron_tc.distill.rundir import RunManifest, RunPaths, run_info, stage_fingerprints, write_json
from megatron_tc.distill.signals import ExitSignals, signal_name
from megatron_tc.monitor import TBWriter, get_logger

log = get_logger(__name__)


class StageStopped(Exception):
    """A training stage stopped early on request (stop_after or a signal); the pipeline ends there."""


class StoppedBySignal(Exception):
    """A signal of run.exit_signals stopped the run at a checkpoint (megatron_tc.distill.signals);
    the CLI exits with 128 + `signum`."""

    def __init__(self, signum: int, stage: str):
        super().__init__(f"{signal_name(signum)} received during {stage}: stopped with its state saved; "
                         "run the same command again to resume")
        self.signum, self.stage = signum, stage


TRAINING_STAGES = ("pretrain", "stage1", "stage2")


# ---- the training stages (thin wrappers that load inputs and save the student) ----------------------

def _training_student_source(ctx: RunContext, stage: str) -> Path:
    if stage == "stage2" and (ctx.paths.student("stage1") / "manifest.json").is_file() and "stage1" in ctx.cfg.run.stages:
        return ctx.paths.student("stage1")
    if not (ctx.paths.init_student / "manifest.json").is_file():
        raise FileNotFoundError(f"{ctx.paths.init_student} does not exist: run the init stage first")
    return ctx.paths.init_student


def _release_changed_teacher(ctx: RunContext, teacher: torch.nn.Module) -> None:
    """A training stage casts the shared teacher to bf16 (run.precision=bf16 on CUDA) or partitions
    it (parallel.teacher_mode=engine) in place; later stages (eval) then load it again in fp32."""
    if ctx.cfg.parallel.teacher_mode != "replicated" or any(p.dtype != torch.float32 for p in teacher.parameters()):
        ctx.release_teacher()


def _loader(ctx: RunContext):
    d = ctx.cfg.data
    return ctx.data().loader("train", global_batch_size=d.global_batch_size, micro_batch_size=d.micro_batch_size,
                             dp_rank=ctx.par.dp_rank, dp_size=ctx.par.dp_size, seed=ctx.cfg.run.seed)


def run_stage1(ctx: RunContext, stop_after: int | None = None) -> dict[str, Any]:
    from megatron_tc.calibrate.student import converted_layers
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm
    from megatron_tc.distill.context import rank0_save_student
    from megatron_tc.distill.stage1 import build_stage1, merged_student_state

    source = _training_student_source(ctx, "stage1")
    student = load_hybrid_lm(source)
    layers = converted_layers(student.arch.layer_pattern)
    teacher = ctx.teacher().model
    trainer, _ = build_stage1(ctx.cfg, ctx.par, student, teacher, _loader(ctx), layers,
                              ctx.paths.stage_dir("stage1"), ctx.tb, ctx.device)
    with trainer:
        state, stopped = trainer.run(stop_after)
        if stopped:
            raise StageStopped(f"stage1 stopped at step {state.step}")
        merged = merged_student_state(student, trainer)
    rank0_save_student(ctx, merged, student.arch, ctx.paths.student("stage1"),
                       {"stage": "stage1", "from": str(source), "steps": state.step})
    _release_changed_teacher(ctx, teacher)
    return {"steps": state.step, "tokens": state.tokens_seen, "skipped_steps": state.skipped_steps}


def run_stage2(ctx: RunContext, stop_after: int | None = None) -> dict[str, Any]:
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm
    from megatron_tc.distill.context import rank0_save_student
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.stage2 import build_stage2, evaluates_while_training

    source = _training_student_source(ctx, "stage2")
    student = load_hybrid_lm(source)
    arch = student.arch
    rows = window_rows(ctx.eval_windows()) if evaluates_while_training(ctx.cfg.distill) else []
    bos = ctx.data().bos_record()  # every rank: preparing the data is collective
    if ctx.rank0:
        write_json(ctx.paths.root / "run.json", {"name": ctx.paths.root.name, "init": ctx.cfg.calibrate.init,
                                                 "policy": ctx.cfg.model.policy, "teacher": ctx.cfg.model.teacher,
                                                 "student": str(source), **bos})
    teacher = ctx.teacher().model
    trainer = build_stage2(ctx.cfg, ctx.par, student, teacher, _loader(ctx), rows,
                           ctx.paths.stage_dir("stage2"), ctx.tb, ctx.device,
                           tensorboard_dir=str(ctx.paths.tensorboard), eval_log=ctx.paths.eval_log)
    memo_key = _share_evaluations(ctx, trainer, rows)
    with trainer:
        result = trainer.run(stop_after)
    if result.stopped_early:
        raise StageStopped(f"stage2 stopped at step {result.steps}")
    rank0_save_student(ctx, result.student_state, arch, ctx.paths.student("stage2"),
                       {"stage": "stage2", "from": str(source), "steps": result.steps, "tokens": result.tokens})
    if memo_key is not None:  # the eval stage scores these two checkpoints on the same rows
        ctx.eval_memo().remember(memo_key, source, trainer.scores_by_step.get(0))
        ctx.eval_memo().remember(memo_key, ctx.paths.student("stage2"), trainer.scores_by_step.get(result.steps))
    _release_changed_teacher(ctx, teacher)
    return {"steps": result.steps, "tokens": result.tokens, "skipped_steps": result.skipped_steps,
            "last_eval": result.last_eval}


def _share_evaluations(ctx: RunContext, trainer: Any, rows: list[torch.Tensor]) -> str | None:
    """When stage 2 scores the held-out rows as the eval stage would (fp32, eager, whole vocabulary),
    its teacher log-probs go into the run's memo; returns the rows' memo key (None: nothing shared)."""
    from megatron_tc.distill.eval_memo import EvalMemo, computes_like_eval_stage
    from megatron_tc.distill.evaluation import eval_batch_size

    if not rows or ctx.par.pp_size > 1 or ctx.shard_teacher():
        return None
    if not (computes_like_eval_stage(trainer.engine, ctx.par.tp_size, trainer.compiled)
            and computes_like_eval_stage(trainer.teacher)):
        return None
    key = EvalMemo.rows_key(rows, eval_batch_size(ctx.cfg), ctx.par.dp_rank, ctx.par.dp_size)
    trainer.teacher_cache = ctx.eval_memo().teacher_cache(key)
    return key


# ---- the table of stages -----------------------------------------------------------------------------

def _stage_table() -> dict[str, tuple[Callable[..., dict], Callable[[RunPaths, Any], list[Path]]]]:
    from megatron_tc.distill import final, stages

    from megatron_tc.distill.pretrain import pretrain_outputs, run_pretrain

    return {
        "pretrain": (run_pretrain, pretrain_outputs),
        "convert": (stages.run_convert, lambda p, c: [p.teacher / "manifest.json"]),
        "select": (stages.run_select, lambda p, c: [p.selection]),
        "stats": (stages.run_stats, lambda p, c: [p.stats]),
        "init": (stages.run_init, lambda p, c: [p.init_student / "manifest.json"]),
        "stage1": (run_stage1, lambda p, c: [p.student("stage1") / "manifest.json"]),
        "stage2": (run_stage2, lambda p, c: [p.student("stage2") / "manifest.json"]),
        "eval": (final.run_eval, lambda p, c: [p.results]),
        "export": (final.run_export, lambda p, c: [p.export / f for f in c.export.formats]),
    }


def _forget_outputs(ctx: RunContext, stage: str) -> None:
    """A forced stage starts from nothing: training stages lose their checkpoints and logs."""
    if not ctx.rank0:
        return
    if stage in ("stage1", "stage2", "pretrain"):
        shutil.rmtree(ctx.paths.stage_dir(stage), ignore_errors=True)
        if stage == "stage2":
            ctx.paths.eval_log.unlink(missing_ok=True)


def _broadcast(value: Any) -> Any:
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def known_teacher_arch(cfg: Any):
    """The teacher's ArchConfig when it can be read without its weights: the run directory's
    converted teacher, else model.teacher (a megatron_tc checkpoint, an HF directory or a GGUF
    file); None when there is nothing to read yet (a `pkg:` teacher the convert stage installs)."""
    from megatron_tc.config import teacher_arch
    from megatron_tc.convert.checkpoint import is_checkpoint, read_info

    converted = RunPaths.from_config(cfg).teacher
    if is_checkpoint(converted):
        return read_info(converted).arch
    return teacher_arch(cfg)


def config_fingerprints(cfg: Any) -> dict[str, str]:
    """Stage -> the fingerprint its manifest entry must carry to count as complete for `cfg`."""
    from megatron_tc.config import config_to_dict

    # the pretrain stage joins the fingerprint chain only when it runs (runs without it keep theirs)
    return stage_fingerprints(config_to_dict(cfg), [s for s in STAGES if s != "pretrain" or s in cfg.run.stages])


def input_fingerprint(cfg: Any, fingerprints: dict[str, str], stage: str) -> str | None:
    """The fingerprint of what a training stage starts from (stage 1: the init student; stage 2:
    stage 1's student when stage 1 runs, else the init student); None for the other stages."""
    if stage == "stage1" or (stage == "stage2" and "stage1" not in cfg.run.stages):
        return fingerprints["init"]
    return fingerprints["stage1"] if stage == "stage2" else None


def starts_over(entry: dict[str, Any], input_fp: str | None) -> bool:
    """Whether a training stage's checkpoints were trained from another input than the one it has
    now (a new init student, other data, another teacher): then it must not resume from them. Its
    own keys (steps, learning rate) may change: it resumes with them, as Megatron-LM does."""
    return input_fp is not None and entry.get("input") not in (None, input_fp)


def check_teacher_exists(cfg: Any) -> None:
    """A run that converts the teacher needs model.teacher to exist (unless the run directory
    holds the converted teacher already): said on every rank before any process group exists."""
    from megatron_tc.config import ConfigError, resolve_path
    from megatron_tc.convert.checkpoint import is_checkpoint

    teacher = cfg.model.teacher
    if not teacher or "convert" not in cfg.run.stages or is_checkpoint(RunPaths.from_config(cfg).teacher):
        return
    if teacher.startswith("pkg:"):
        return  # installed on demand by the convert stage (stages.TEACHER_PACKAGES)
    if not resolve_path(teacher).exists():
        raise ConfigError(f"model.teacher={teacher} does not exist: give an HF model directory, a .gguf file "
                          "or a megatron_tc checkpoint")


def _setup(cfg: Any) -> RunContext:
    from megatron_tc.config import resolve_config, save_config
    from megatron_tc.monitor import setup_logging
    from megatron_tc.parallel.memory import least_device_memory
    from megatron_tc.parallel.state import init_distributed, init_parallel, shared_outcome

    ensure_process_group_env()
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    cfg = resolve_config(cfg, world_size)  # checks (before any process group exists), fills parallel.dp
    check_teacher_exists(cfg)
    arch = known_teacher_arch(cfg)
    if arch is not None:  # else (a GGUF not converted yet) the check runs right after the convert stage
        from megatron_tc.config import validate_against_arch

        validate_against_arch(cfg, arch, world_size)
    setup_logging(cfg.logging.level)
    device = pick_device(cfg)
    if device.type == "cpu":  # every CPU step allocates and frees ~1 GiB: keep it instead of faulting it in again
        log.info("host memory: %s", keep_freed_host_memory())
    # 'auto': the device the run computes on decides (run.device=cpu on a GPU machine takes gloo)
    init_distributed(("nccl" if device.type == "cuda" else "gloo") if cfg.parallel.backend == "auto"
                     else cfg.parallel.backend)
    par = init_parallel(cfg.parallel.tp, cfg.parallel.pp)
    # the auto choices (ZeRO stage, split teacher) read the smallest device of the job; agreed here,
    # where every rank is, so a stage that decides later needs no collective of its own
    least_device_memory(device)
    torch.manual_seed(cfg.run.seed)
    paths = RunPaths.from_config(cfg)

    def make_run_dir() -> None:
        paths.root.mkdir(parents=True, exist_ok=True)
        save_config(cfg, paths.root)

    shared_outcome(make_run_dir if par.rank == 0 else None)  # an unwritable run.run_dir: every rank says so
    return RunContext(cfg, paths, par, device, TBWriter(paths.tensorboard))


def run_pipeline(cfg: Any, force: list[str] | tuple[str, ...] = (), stop_after: int | None = None) -> dict[str, Any]:
    """Run cfg.run.stages in order; returns {stage: summary or 'skipped'}. `force`: stage names
    (or 'all') to rerun from scratch. `stop_after`: stop a training stage after that many steps
    (checkpointed; the next invocation resumes)."""
    unknown = [s for s in force if s not in STAGES and s != "all"]
    if unknown:
        from megatron_tc.config import ConfigError

        raise ConfigError(f"--force {unknown}: not a stage; stages are {', '.join(STAGES)} (or 'all')")
    ctx = _setup(cfg)
    cfg = ctx.cfg
    fingerprints = config_fingerprints(cfg)

    def open_manifest() -> RunManifest:  # rank 0's; a damaged one stops every rank with its line
        manifest = RunManifest(ctx.paths.root)
        manifest.data["run"] = run_info() | {"stages": list(cfg.run.stages)}
        manifest.save()
        return manifest

    manifest = ctx.on_rank0(open_manifest)
    table = _stage_table()
    results: dict[str, Any] = {}
    started = time.time()
    try:
        for stage in cfg.run.stages:
            fn, outputs = table[stage]
            forced = stage in force or "all" in force
            input_fp = input_fingerprint(cfg, fingerprints, stage)
            skip = restart = None
            if ctx.rank0:
                skip = not forced and manifest.is_complete(stage, fingerprints[stage], outputs(ctx.paths, cfg))
                restart = not skip and not forced and starts_over(manifest.entry(stage), input_fp)
            skip, restart = _broadcast((skip, restart))
            if skip:
                log.info("stage %s: complete for this config, skipped (--force %s reruns it)", stage, stage)
                results[stage] = "skipped"
                continue
            if restart:
                log.warning("stage %s: what it trains from changed since its checkpoints were written (the student "
                            "before it, the data or the teacher): it starts over", stage)
            if forced or restart:
                _forget_outputs(ctx, stage)
            results[stage] = _run_stage(ctx, manifest, stage, fn, outputs, fingerprints[stage], stop_after, input_fp)
            if results[stage] == "stopped":
                break
    finally:
        ctx.tb.close()
    if ctx.rank0:
        manifest.data["run"]["seconds"] = round(time.time() - started, 1)
        manifest.save()
        print_closing_note(ctx)
    return results


def _run_stage(ctx: RunContext, manifest: RunManifest | None, stage: str, fn: Callable, outputs: Callable,
               fingerprint: str, stop_after: int | None, input_fp: str | None = None) -> Any:
    """Run one stage, its state in the manifest (rank 0) before and after: its summary, or
    "stopped" when a training stage stopped at `stop_after` steps (checkpointed). A signal
    listed in run.exit_signals stops a training stage at a step boundary (StoppedBySignal)."""
    inputs = {} if input_fp is None else {"input": input_fp}  # training stages: what they start from
    if ctx.rank0:
        manifest.mark(stage, "running", fingerprint, **inputs)
    ctx.barrier()
    log.info("stage %s: running", stage)
    t0 = time.time()
    training = stage in TRAINING_STAGES
    signals = ExitSignals(ctx.cfg.run.exit_signals if training else ())
    try:
        with signals:
            summary = fn(ctx, stop_after=stop_after) if training else fn(ctx)
    except StageStopped as stop:
        if ctx.rank0:
            manifest.mark(stage, "stopped", fingerprint, seconds=round(time.time() - t0, 1), **inputs)
        if signals.received:
            raise StoppedBySignal(signals.received, stage) from None
        log.info("%s; run the same command again to resume", stop)
        return "stopped"
    except BaseException:
        if ctx.rank0:
            manifest.mark(stage, "failed", fingerprint, seconds=round(time.time() - t0, 1), **inputs)
        raise
    if stage == "convert":
        from megatron_tc.config import validate_against_arch

        validate_against_arch(ctx.cfg, ctx.teacher_meta().model.arch, dist.get_world_size())
    seconds = round(time.time() - t0, 1)
    if ctx.rank0:
        if (bos := ctx.bos_record()) is not None:  # the convention every data-reading stage used
            manifest.data["data"] = bos
        manifest.mark(stage, "complete", fingerprint, outputs(ctx.paths, ctx.cfg), seconds=seconds, summary=summary,
                      **inputs)
        ctx.tb.scalar(f"time/{stage}_s", seconds, 0)
    log.info("stage %s: done in %.1f s", stage, seconds)
    if training and (signum := signals.agreed(ctx.device)):  # arrived after the loop's last check
        raise StoppedBySignal(signum, stage)
    return summary


def print_closing_note(ctx: RunContext) -> None:
    """The table of the eval stage and where to look next."""
    from megatron_tc.distill.final import format_table

    lines = []
    if ctx.paths.results.is_file():
        lines += ["", format_table(json.loads(ctx.paths.results.read_text()))]
    lines += ["", f"Run directory:     {ctx.paths.root}",
              f"TensorBoard logs:  tensorboard --logdir {ctx.paths.tensorboard}"]
    if ctx.paths.export.is_dir():
        for fmt in sorted(p.name for p in ctx.paths.export.iterdir() if p.is_dir()):
            lines.append(f"Exported model:    {ctx.paths.export / fmt}" + (
                "  (transformers: import megatron_tc; AutoModelForCausalLM.from_pretrained(...))" if fmt == "hf" else ""))
    print("\n".join(lines), flush=True)
