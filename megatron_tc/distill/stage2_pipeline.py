"""Stage 2 with pipeline parallelism (PP > 1): DeepSpeed's pipeline engine with ZeRO stage <= 1,
tensor parallelism (megatron-core layers) inside each stage when parallel.tp > 1.

The pipeline module of `megatron_tc.parallel.pipeline` holds, per stage, the student's and the
frozen teacher's layers of its span and computes the KL on the last stage; `engine.train_batch`
runs one optimizer step over the micro-batches (1F1B schedule). Everything else — schedule,
checkpoints, NaN policy, logs — is the ZeRO trainer's. Differences, by construction of the
pipeline engine: the loss is known only after the step (DeepSpeed's ZeRO-1 skips a non-finite
update itself; nan_policy 'abort' stops right after), only the KL (+ CE) objective exists (no
hidden-state term), and periodic evaluation is left to the eval stage.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.distill.numerics import NonFiniteGuard, all_finite
from megatron_tc.distill.schedule import apply_lr
from megatron_tc.distill.stage2 import Stage2Trainer, select_trainable
from megatron_tc.distill.stage2_setup import restore_vocab_padding, shard_over_tp, stage2_deepspeed_config
from megatron_tc.monitor import get_logger

log = get_logger(__name__)


class PipelineStage2Trainer(Stage2Trainer):
    def __init__(self, *args, student: nn.Module, **kwargs):
        super().__init__(*args, **kwargs)
        self.student = student

    def train_step(self, state, guard: NonFiniteGuard) -> dict[str, float]:
        from megatron_tc.parallel.pipeline import pipeline_batches

        step = state.step
        lr = apply_lr(self.engine.optimizer.param_groups, self.schedule, step)
        micro = self.loader.next_step()
        batches = pipeline_batches([(mb["input_ids"], mb["labels"], mb["doc_ids"]) for mb in micro])
        loss = self.engine.train_batch(data_iter=batches)
        applied = self.engine.was_step_applied()
        if not all_finite(loss.detach().float().reshape(1)):
            guard.record(step, "loss")  # DeepSpeed skipped the update; 'abort' raises here
        elif not applied:
            guard.record(step, "gradient")
        grad_norm = self.engine.get_global_grad_norm() if applied else float("nan")
        value = float(loss)
        return {"loss": value, "kl": value if not self.weights.ce_weight else float("nan"), "ce": 0.0, "hidden": 0.0,
                "lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "applied": float(applied)}

    def extra_state(self) -> dict[str, torch.Tensor]:
        """DeepSpeed's pipeline checkpoints skip tied layers (their forward is a function), so the
        tied student embedding is saved by us and restored after the engine's load."""
        return {f"{key}.{name}": t for key, module in self.engine.module.tied_modules.items()
                for name, t in module.state_dict().items()}

    def restore_extra(self, extra: dict[str, torch.Tensor] | None) -> None:
        mine = self.extra_state()
        if mine and extra is None:
            raise RuntimeError("the checkpoint holds no tied-layer weights for this pipeline stage")
        with torch.no_grad():
            for name, tensor in mine.items():
                tensor.copy_(extra[name])

    def gather_student(self) -> dict[str, torch.Tensor] | None:
        return gather_pipeline_student(self.student, self.engine, self.ctx)


def gather_pipeline_student(student: nn.Module, engine: Any, ctx: Any) -> dict[str, torch.Tensor] | None:
    """The full student state on global rank 0: every pipeline stage (of data-parallel replica 0)
    contributes the student tensors of its span, tensor-parallel shards gathered to their full size
    first. Collective over the tensor- and pipeline-parallel groups."""
    from megatron_tc.parallel.tensor_parallel import gather_full

    local = {id(p) for p in engine.module.parameters()}
    mine = {name: gather_full(p.detach(), p, ctx).float().cpu().clone()
            for name, p in student.named_parameters() if id(p) in local}
    if ctx.dp_rank != 0 or ctx.tp_rank != 0:
        return None
    parts: list[Any] = [None] * ctx.pp_size
    dist.all_gather_object(parts, mine, group=ctx.pp_group)
    if ctx.rank != 0:
        return None
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part)
    missing = sorted(set(student.state_dict()) - set(state))
    if missing:
        raise RuntimeError(f"pipeline stages did not cover the student tensors {missing[:5]}")
    return restore_vocab_padding(state, student)


def build_pipeline_stage2(cfg: Any, ctx: Any, student: nn.Module, teacher: nn.Module, loader: Any, out_dir: Path,
                          tb: Any, device: torch.device, tensorboard_dir: str | None = None,
                          eval_log: Path | None = None) -> PipelineStage2Trainer:
    from megatron_tc.parallel.pipeline import DistillLoss, build_pipeline_engine

    s2 = cfg.distill.stage2
    if s2.hidden_weight:
        raise ValueError("distill.stage2.hidden_weight > 0 is not available with parallel.pp > 1 (the pipeline "
                         "passes only hidden states of the current stage); set it to 0 or use pp=1")
    if cfg.distill.eval_interval or cfg.distill.eval_steps:
        log.info("stage2 with pp > 1: no periodic evaluation (the eval stage scores the final student)")
    out_dir.mkdir(parents=True, exist_ok=True)
    if ctx.tp_size > 1:  # megatron-core layers inside each stage; the loss reduces over the vocabulary shards
        student, teacher = shard_over_tp(student, teacher, ctx)
    select_trainable(student, s2.trainable)
    student.to(device)
    ds_config = stage2_deepspeed_config(cfg, ctx, device, tensorboard_dir, student)
    loss_fn = DistillLoss(student.arch.vocab_size, s2.temperature, s2.ce_weight,
                          ctx.tp_group if ctx.tp_size > 1 else None)
    engine = build_pipeline_engine(student, teacher.to(device), ds_config, ctx, loss_fn,
                                   partition=cfg.parallel.pipeline_partition,
                                   activation_checkpointing=cfg.parallel.activation_checkpointing)
    return PipelineStage2Trainer(cfg, ctx, engine, teacher, loader, [], out_dir, tb, device,
                                 student.arch.vocab_size, eval_log, student=student)
