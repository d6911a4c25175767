"""Stage 1: every converted layer aligned at once, teacher-forced, by MSE to the teacher's attention.

Per micro-batch the frozen teacher runs up to its last converted layer (calibrate.capture hooks)
and hands over, for each converted layer l, its mixer input x_l and attention output y_l (after
o_proj). The student's GDN mixers — the only trainable parameters, wrapped in one module under a
DeepSpeed engine (ZeRO over the data-parallel group) — map x_l to o_l, and the loss is

    loss = mean_l  mean|o_l - y_l|^2 / mean|y_l|^2        (relative MSE, averaged over layers)

so layers with large and small attention outputs weigh alike (distill.stage1.loss='rmse': the paper's
authors' mean per-token |o_l - y_l| / sqrt(hidden) instead). Per-layer relative MSE goes to
TensorBoard (`stage1/mse/L{l}`); checkpoints, NaN policy and the schedule are those of stage 2.
At the end the aligned mixers are merged into the student, saved by the caller. With parallel.tp > 1
the student (in place) and a copy of the teacher are tensor-parallel (the mixers' outputs after the
row-parallel o_proj are whole, so the loss is unchanged) and the merge gathers the shards.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_tc.distill import faults
from megatron_tc.distill.checkpointing import CheckpointManager, TrainState, latest_zero_stage
from megatron_tc.distill.evaluation import append_jsonl, truncate_jsonl
from megatron_tc.distill.numerics import NonFiniteError, NonFiniteGuard, all_finite
from megatron_tc.distill.schedule import LRSchedule, apply_lr, remember_peak_lr
from megatron_tc.distill.signals import signal_name, stop_requested
from megatron_tc.distill.stage2 import gather_full_state
from megatron_tc.distill.stage2_setup import restore_vocab_padding
from megatron_tc.monitor import get_logger, progress
from megatron_tc.parallel.comm import all_reduce_
from megatron_tc.parallel.deepspeed_engine import EngineOwner

log = get_logger(__name__)
TRAIN_LOG = "train_log.jsonl"


class ConvertedMixers(nn.Module):
    """The student's GDN mixers of the converted layers, trained together.

    forward(xs: tuple of [B, T, hidden] per layer (sorted layer order), doc_ids [B, T]) -> tuple of
    [B, T, hidden] outputs."""

    def __init__(self, student: nn.Module, layers: list[int]):
        super().__init__()
        self.layer_ids = sorted(layers)
        self.mixers = nn.ModuleDict({str(l): student.layers[l].mixer for l in self.layer_ids})

    def forward(self, xs: tuple[torch.Tensor, ...], doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return tuple(self.mixers[str(l)](x, doc_ids=doc_ids) for l, x in zip(self.layer_ids, xs))


def relative_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean|out - target|^2 / mean|target|^2 (fp32)."""
    out, target = out.float(), target.float()
    return (out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)


def token_rmse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean over tokens of |out_t - target_t| / sqrt(hidden) (fp32): the paper's authors' stage-1 loss."""
    out, target = out.float(), target.float()
    return torch.linalg.vector_norm(out - target, dim=-1).mean() * out.shape[-1] ** -0.5


STAGE1_LOSSES = {"relative_mse": relative_mse, "rmse": token_rmse}


def stage1_steps(cfg: Any) -> int:
    """Optimizer steps of stage 1: from distill.stage1.tokens, or stage2_fraction of the stage-2
    tokens, over global_batch_size * seq_len tokens per step; else distill.stage1.steps."""
    s1 = cfg.distill.stage1
    tokens = s1.tokens
    if s1.stage2_fraction is not None:
        tokens = s1.stage2_fraction * cfg.distill.stage2.tokens
    if tokens is None:
        return s1.steps
    # a fraction written to a few digits (1/6 as 0.1666667) must not round up to one more step
    return max(1, math.ceil(round(tokens / (cfg.data.global_batch_size * cfg.data.seq_len), 3)))


def teacher_io(teacher: nn.Module, batch: dict[str, torch.Tensor], layers: list[int]):
    """(xs, ys): the teacher's mixer inputs and attention outputs of `layers` for one batch."""
    from megatron_tc.calibrate.capture import capture_layers

    xs: dict[int, torch.Tensor] = {}
    ys: dict[int, torch.Tensor] = {}

    def keep(index, io):
        xs[index], ys[index] = io.x.detach(), io.out.detach()

    capture_layers(teacher, batch["input_ids"], batch.get("doc_ids"), layers, keep)
    return tuple(xs[l] for l in sorted(layers)), tuple(ys[l] for l in sorted(layers))


class Stage1Trainer(EngineOwner):
    def __init__(self, cfg: Any, ctx: Any, engine: Any, teacher: nn.Module, loader: Any, layers: list[int],
                 out_dir: Path, tb: Any, device: torch.device):
        self.cfg, self.ctx, self.engine, self.teacher, self.loader = cfg, ctx, engine, teacher, loader
        self.compute_dtype = next(engine.module.parameters()).dtype
        self.layers, self.out_dir, self.tb, self.device = sorted(layers), out_dir, tb, device
        s1 = cfg.distill.stage1
        self.steps = stage1_steps(cfg)
        self.loss_fn = STAGE1_LOSSES[s1.loss]
        self.schedule = LRSchedule(max(1, self.steps), min(s1.warmup_steps, max(1, self.steps)), "cosine", 0.1)
        self.manager = CheckpointManager(out_dir / "checkpoints", cfg.distill.keep_last)
        self.layout = {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
                       "zero": engine.zero_optimization_stage()}
        self.rank0 = ctx.rank == 0
        remember_peak_lr(engine.optimizer.param_groups)

    def _resume(self) -> TrainState:
        state = self.manager.load(self.engine, self.layout)
        if state is None:
            if self.rank0:
                (self.out_dir / TRAIN_LOG).unlink(missing_ok=True)
            return TrainState(layout=dict(self.layout))
        self.loader.load_state_dict(state.data)
        if self.rank0:
            truncate_jsonl(self.out_dir / TRAIN_LOG, "step", state.step)
        log.info("stage1: resumed at step %d", state.step)
        return state

    def _step(self, state: TrainState, guard: NonFiniteGuard) -> dict[str, float]:
        step = state.step
        lr = apply_lr(self.engine.optimizer.param_groups, self.schedule, step)
        micro = self.loader.next_step()
        per_layer = torch.zeros(len(self.layers), dtype=torch.float64)
        finite = True
        for batch in micro:
            batch = {k: v.to(self.device) for k, v in batch.items() if k in ("input_ids", "doc_ids")}
            xs, ys = teacher_io(self.teacher, batch, self.layers)
            # the teacher may run in another precision than the engine's mixers (fp32 teacher, bf16 engine)
            xs = tuple(x.to(self.compute_dtype) for x in xs)
            outs = self.engine(xs, batch.get("doc_ids"))
            losses = torch.stack([self.loss_fn(o, y) for o, y in zip(outs, ys)])
            loss = losses.mean()
            if faults.active("nan_loss", step):
                loss = loss * float("nan")
            if not all_finite(loss):
                finite = False
                if guard.policy == "abort":
                    guard.record(step, "loss")
            self.engine.backward(loss)
            self.engine.step()
            per_layer += losses.detach().double().cpu() / len(micro)
        applied = self.engine.was_step_applied()
        if not finite and applied:
            raise NonFiniteError(f"stage1 step {step}: an update from a non-finite loss was applied; use ZeRO >= 1")
        if not finite or not applied:
            guard.record(step, "loss" if not finite else "gradient")
        if self.ctx.dp_size > 1:
            all_reduce_(per_layer, group=self.ctx.dp_group)  # CPU fp64: through the GPU under NCCL
            per_layer /= self.ctx.dp_size
        grad_norm = self.engine.get_global_grad_norm() if applied else float("nan")
        return {"loss": float(per_layer.mean()), "lr": lr, "applied": float(applied),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                **{f"mse/L{l:02d}": float(v) for l, v in zip(self.layers, per_layer)}}

    def run(self, stop_after: int | None = None) -> tuple[TrainState, bool]:
        state = self._resume()
        guard = NonFiniteGuard(self.cfg.distill.nan_policy, self.cfg.distill.max_skipped, state.skipped_steps)
        every = self.cfg.distill.checkpoint_interval
        bar = progress(total=self.steps, initial=state.step, desc="stage1", unit="step",
                       enabled=self.cfg.logging.progress_bar)
        stopped = False
        while state.step < self.steps:
            start = time.perf_counter()
            scalars = self._step(state, guard)
            state.step += 1
            state.tokens_seen += self.loader.tokens_per_step
            state.skipped_steps = guard.skipped
            seconds = time.perf_counter() - start
            scalars.update(tokens_seen=state.tokens_seen, tokens_per_s=self.loader.tokens_per_step / max(seconds, 1e-9),
                           skipped_steps=state.skipped_steps)
            if self.rank0:
                append_jsonl(self.out_dir / TRAIN_LOG, {"step": state.step, **scalars})
            if state.step % max(1, self.cfg.logging.log_interval) == 0 or state.step == self.steps:
                self.tb.scalars(scalars, state.step, prefix="stage1")
            bar.update(1)
            bar.set_postfix(mse=f"{scalars['loss']:.4f}")
            stopping = stop_after is not None and state.step >= stop_after and state.step < self.steps
            if state.step < self.steps and (signum := stop_requested(self.device)):
                log.info("stage1: %s received: checkpoint at step %d, then stop", signal_name(signum), state.step)
                stopping = True
            if (every and state.step % every == 0) or stopping or state.step == self.steps:
                state.data, state.layout = self.loader.state_dict(), dict(self.layout)
                self.manager.save(self.engine, state)
            faults.maybe_kill("step", state.step)
            if stopping:
                stopped = True
                break
        bar.close()
        return state, stopped


def build_stage1(cfg: Any, ctx: Any, student: nn.Module, teacher: nn.Module, loader: Any, layers: list[int],
                 out_dir: Path, tb: Any, device: torch.device) -> tuple[Stage1Trainer, ConvertedMixers]:
    """The DeepSpeed engine over the converted mixers (stage-1 lr) and the trainer."""
    from megatron_tc.distill.stage2_setup import stage2_deepspeed_config
    from megatron_tc.parallel.deepspeed_engine import build_student_engine, freeze

    if not layers:
        raise ValueError("stage1 needs converted (Gated DeltaNet) layers; the layer pattern has none")
    if ctx.pp_size > 1:
        raise ValueError(f"stage1 runs with parallel.pp=1 (got pp={ctx.pp_size}); its layers are "
                         "independent, so use data (and tensor) parallelism")
    out_dir.mkdir(parents=True, exist_ok=True)
    if ctx.tp_size > 1:  # in place for the student (the caller merges from it), a copy of the teacher
        from megatron_tc.distill.stage2_setup import shard_over_tp

        student, teacher = shard_over_tp(student, teacher, ctx)
    wrapped = ConvertedMixers(student, layers)
    wrapped.requires_grad_(True)
    ds = stage2_deepspeed_config(cfg, ctx, device, None, wrapped,
                                 resume_stage=latest_zero_stage(out_dir / "checkpoints"))
    ds["optimizer"]["params"]["lr"] = cfg.distill.stage1.lr
    ds["optimizer"]["params"]["weight_decay"] = 0.0
    engine = build_student_engine(wrapped, ds, ctx)
    freeze(teacher)
    return Stage1Trainer(cfg, ctx, engine, teacher.to(device), loader, layers, out_dir, tb, device), wrapped


def merged_student_state(student: nn.Module, trainer: Stage1Trainer) -> dict[str, torch.Tensor] | None:
    """The student's full state with the trained mixers (rank 0; None elsewhere). Collective; a
    tensor-parallel student's shards are gathered to the single-device tensors."""
    from megatron_tc.parallel.tensor_parallel import gather_full

    ctx = trainer.ctx
    mixers = gather_full_state(trainer.engine, ctx)
    params = dict(student.named_parameters())
    state = {}
    for name, value in student.state_dict().items():
        if any(name.startswith(f"layers.{l}.mixer.") for l in trainer.layers):
            continue  # trained: taken from the engine
        if ctx.tp_size > 1 and name in params:
            value = gather_full(value, params[name], ctx)
        state[name] = value.detach().cpu().clone()
    if mixers is None:
        return None
    for name, value in mixers.items():  # "mixers.<l>.<param>" -> "layers.<l>.mixer.<param>"
        _, layer, rest = name.split(".", 2)
        state[f"layers.{layer}.mixer.{rest}"] = value
    return restore_vocab_padding(state, student)
