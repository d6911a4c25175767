"""Stage 2: end-to-end distillation of the student on the teacher's logits, under DeepSpeed.

Per optimizer step, for each of this rank's micro-batches: the frozen teacher's logits (no grad),
the student's logits through the DeepSpeed engine (ZeRO-3 over the data-parallel group), the loss
of `megatron_tc.distill.losses` (KL at a temperature, optional CE and hidden-state terms), backward;
then one engine step with our warmup + cosine learning rate and DeepSpeed's gradient clipping.

A non-finite loss is agreed on by all ranks before backward; with nan_policy 'abort' the run stops
there, with 'skip' the NaN gradients make DeepSpeed's ZeRO step skip the update (it checks the
global gradient norm), and the step is counted. Every `eval_interval` steps the student is scored
on held-out windows (perplexity, KL, top-1 agreement) into `eval_log.jsonl` and TensorBoard; every
`checkpoint_interval` steps a resumable checkpoint is written (see checkpointing.py). At the end the
full student is gathered and saved as a megatron_tc checkpoint in `<out_dir>/student`.

Files under `out_dir`: checkpoints/, train_log.jsonl (one record per step, DP-averaged losses) and
the eval log (default `out_dir/eval_log.jsonl`; the pipeline puts it at `<run_dir>/eval_log.jsonl`),
the format `megatron_tc.eval.tokens_to_target` reads: {"step", "tokens" (training tokens seen),
"ppl", "kl", "top1_agree", "teacher_ppl", "eval_tokens"}, with the zero-shot point at tokens 0.

With parallel.tp > 1 (pp = 1) the student and the teacher are sharded by
`parallel.tensor_parallel.apply_tensor_parallel` before their engines are built (a teacher loaded
split by `parallel.sharded_teacher` is used as it is): DeepSpeed gets the
TP groups through `mpu` (ZeRO-3 over DP; gradient norms over TP), the losses and the evaluation
work on vocabulary shards, DeepSpeed checkpoints hold one partition per TP rank, and the final
student is gathered to its single-device form.
"""
from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.distill import faults
from megatron_tc.distill.checkpointing import CheckpointManager, TrainState, latest_zero_stage
from megatron_tc.distill.evaluation import TeacherCache, append_jsonl, eval_batch_size, score_rows, truncate_jsonl
from megatron_tc.distill.losses import LossWeights, distill_loss
from megatron_tc.distill.numerics import NonFiniteError, NonFiniteGuard, all_finite
from megatron_tc.distill.schedule import LRSchedule, apply_lr, remember_peak_lr
from megatron_tc.distill.signals import signal_name, stop_requested
from megatron_tc.distill.stage2_setup import (resolve_compile, resolve_teacher_compile, restore_vocab_padding,
                                              shard_over_tp, stage2_deepspeed_config)
from megatron_tc.monitor import get_logger, progress
from megatron_tc.parallel.comm import all_reduce_
from megatron_tc.parallel.deepspeed_engine import EngineOwner

log = get_logger(__name__)

TRAIN_LOG, EVAL_LOG = "train_log.jsonl", "eval_log.jsonl"


@dataclass
class Stage2Result:
    steps: int
    tokens: int
    skipped_steps: int
    stopped_early: bool
    last_eval: dict[str, Any] | None
    student_state: dict[str, torch.Tensor] | None  # full fp32 state dict on rank 0, else None


# ---- set-up ---------------------------------------------------------------------------------------

def select_trainable(model: nn.Module, which: str) -> list[str]:
    """Set requires_grad by `which` ('all' | 'mixers' | 'gdn'); return the trainable names."""
    if which not in ("all", "mixers", "gdn"):
        raise ValueError(f"distill.stage2.trainable={which!r}: use all, mixers or gdn")
    names = []
    for name, param in model.named_parameters():
        if which == "all":
            keep = True
        else:
            parts = name.split(".")
            is_mixer = len(parts) > 3 and parts[0] == "layers" and parts[2] == "mixer"
            keep = is_mixer and (which == "mixers" or model.layers[int(parts[1])].kind == "G")
        param.requires_grad_(keep)
        if keep:
            names.append(name)
    if not names:
        raise ValueError(f"distill.stage2.trainable={which!r} selects no parameters of this student "
                         "(no Gated DeltaNet layers?); use 'all'")
    return names


def evaluates_while_training(distill: Any) -> bool:
    """Whether the held-out text is scored during training (distill.eval_interval / eval_steps)."""
    return bool(distill.eval_interval or distill.eval_steps)


def is_eval_step(distill: Any, step: int) -> bool:
    """Step `step` (counted from 1) ends with a held-out evaluation."""
    return bool(distill.eval_interval and step % distill.eval_interval == 0) or step in distill.eval_steps


def total_steps(cfg: Any, tokens_per_step: int) -> int:
    s2 = cfg.distill.stage2
    if s2.tokens is not None:
        return max(1, math.ceil(s2.tokens / tokens_per_step))
    return s2.steps


class _Capture:
    """Keeps the output of a module (the final norm: hidden states [B, T, d]) from the last forward."""

    def __init__(self, module: nn.Module):
        self.value: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.value = output


class _NaNGradient(torch.autograd.Function):
    """Identity forward, NaN backward (the `nan_grad@S` fault)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A CPU batch goes to a GPU through pinned memory without blocking: a
    copy from pageable memory would make the host wait for the work already queued on the device."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def peak_memory_gb(device: torch.device) -> float:
    """The largest peak memory of any rank (GPU allocated, or the process's resident set on CPU):
    pipeline and tensor-parallel ranks hold different parts of the models. Collective."""
    peak = torch.tensor([_memory_gb(device)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce_(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def _dp_mean(values: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.dp_size > 1:
        all_reduce_(values, group=ctx.dp_group)  # CPU fp64: through the GPU under NCCL
        values /= ctx.dp_size
    return values


# ---- the trainer -------------------------------------------------------------------------------------

class Stage2Trainer(EngineOwner):
    """Owns the engines, the loader, the schedule and the bookkeeping of one stage-2 run."""

    def __init__(self, cfg: Any, ctx: Any, engine: Any, teacher: nn.Module, loader: Any, eval_rows: list[torch.Tensor],
                 out_dir: Path, tb: Any, device: torch.device, vocab_size: int, eval_log: Path | None = None):
        self.eval_log = eval_log or out_dir / EVAL_LOG
        self.teacher_cache = TeacherCache()
        self.scores_by_step: dict[int, dict[str, Any]] = {}  # this process's evaluations (score_rows' dicts)
        self.cfg, self.ctx, self.engine, self.teacher, self.loader = cfg, ctx, engine, teacher, loader
        self.eval_rows, self.out_dir, self.tb, self.device, self.vocab_size = eval_rows, out_dir, tb, device, vocab_size
        s2 = cfg.distill.stage2
        self.weights = LossWeights(s2.temperature, s2.ce_weight, s2.hidden_weight)
        self.steps = total_steps(cfg, loader.tokens_per_step)
        self.schedule = LRSchedule(self.steps, min(s2.warmup_steps, self.steps), s2.schedule,
                                   s2.min_lr / s2.lr if s2.lr else 0.0)
        self.manager = CheckpointManager(out_dir / "checkpoints", cfg.distill.keep_last)
        self.layout = {"world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
                       "zero": engine.zero_optimization_stage()}
        self.rank0 = ctx.rank == 0
        self.tp_group = ctx.tp_group if ctx.tp_size > 1 else None
        student_module = engine.module
        self.s_hidden = _Capture(student_module.norm) if s2.hidden_weight else None
        self.t_hidden = _Capture(teacher.module.norm if hasattr(teacher, "module") else teacher.norm) \
            if s2.hidden_weight else None
        remember_peak_lr(engine.optimizer.param_groups)
        self.compiled = False  # the student's decoder layers compiled (build_stage2 sets it)
        self.teacher_compiled = False  # and the teacher's

    # -- resume
    def resume(self) -> TrainState:
        state = self.manager.load(self.engine, self.layout)
        if state is None:
            self.manager.clean_partial()
            if self.rank0:
                for path in (self.out_dir / TRAIN_LOG, self.eval_log):
                    path.unlink(missing_ok=True)
            return TrainState(layout=dict(self.layout))
        self.loader.load_state_dict(state.data)
        self.restore_extra(self.manager.loaded_extra)
        if self.rank0:  # records written after the checkpoint are rewritten by this run
            truncate_jsonl(self.out_dir / TRAIN_LOG, "step", state.step)
            truncate_jsonl(self.eval_log, "step", state.step)
        log.info("stage2: resumed at step %d (%d tokens seen, %d skipped) from %s", state.step,
                 state.tokens_seen, state.skipped_steps, self.manager.latest())
        return state

    # -- one step
    def _forward_loss(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """batch: the packer's tensors [mbs, T] (input_ids, and doc_ids / position_ids / labels)."""
        on = {k: to_device(v, self.device) for k, v in batch.items()}
        ids = on["input_ids"]
        kwargs = {k: on[k] for k in ("doc_ids", "position_ids") if k in on}
        with torch.no_grad():
            t_logits = self.teacher(ids, **kwargs)
        s_logits = self.engine(ids, **kwargs)
        if faults.active("nan_grad", step):
            s_logits = _NaNGradient.apply(s_logits)
        loss, parts = distill_loss(
            s_logits, t_logits, ids, self.vocab_size, self.weights, doc_ids=kwargs.get("doc_ids"),
            labels=on.get("labels"), tp_group=self.tp_group,
            student_hidden=self.s_hidden.value if self.s_hidden else None,
            teacher_hidden=self.t_hidden.value if self.t_hidden else None)
        if faults.active("nan_loss", step):
            loss = loss * float("nan")
        return loss, parts

    def train_step(self, state: TrainState, guard: NonFiniteGuard) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns DP-averaged scalars."""
        step = state.step
        lr = apply_lr(self.engine.optimizer.param_groups, self.schedule, step)
        micro = self.loader.next_step()
        keys = ("loss", "kl", "ce", "hidden")
        # the scalars, then the count of non-finite losses: read together at the end of the step
        totals = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.device)
        for batch in micro:
            loss, parts = self._forward_loss(batch, step)
            # backward is queued before anything waits for the loss: the device never idles while
            # the host launches the backward
            self.engine.backward(loss)
            if guard.policy == "abort" and not all_finite(loss):
                guard.record(step, "loss")  # raises before engine.step(): no update is applied
            # under 'skip' the host does not wait here: a non-finite loss gives non-finite
            # gradients, which make ZeRO's step skip the update, and the count below says why
            self.engine.step()
            zero = totals.new_zeros(())
            values = [parts[k].double() if k in parts else zero for k in keys]
            totals += torch.stack([*(v / len(micro) for v in values), (~torch.isfinite(loss.detach())).double()])
        totals = _dp_mean(totals.cpu(), self.ctx)  # the step's one transfer of its scalars
        finite = bool(totals[-1] == 0)  # the same on every rank: a count > 0 anywhere stays > 0 in the mean
        applied = self.engine.was_step_applied()
        if not finite and applied:
            raise NonFiniteError(f"step {step}: DeepSpeed applied an update computed from a non-finite loss; "
                                 "nan_policy=skip needs ZeRO stage >= 1 (set parallel.zero_stage)")
        if not finite or not applied:
            guard.record(step, "loss" if not finite else "gradient")
        grad_norm = self.engine.get_global_grad_norm() if applied else float("nan")
        out = {k: float(v) for k, v in zip(keys, totals[:-1])}
        out.update(lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                   applied=float(applied))
        return out

    # -- evaluation and logging
    def evaluate(self, state: TrainState) -> dict[str, Any]:
        self.engine.eval()
        try:
            result = score_rows(lambda x: self.engine(x), lambda x: self.teacher(x), self.eval_rows,
                                self.ctx.dp_rank, self.ctx.dp_size, self.ctx.dp_group, self.device,
                                self.teacher_cache, vocab_size=self.vocab_size, tp_group=self.tp_group,
                                batch_size=eval_batch_size(self.cfg))
        finally:
            self.engine.train()
        self.scores_by_step[state.step] = dict(result)
        result["eval_tokens"] = result.pop("tokens")
        record = {"step": state.step, "tokens": state.tokens_seen, **result}
        if self.rank0:
            append_jsonl(self.eval_log, record)
        self.tb.scalars({k: v for k, v in result.items() if k != "eval_tokens"}, state.step, prefix="stage2_eval")
        self.tb.scalars({k: result[k] for k in ("ppl", "kl") if k in result}, state.tokens_seen,
                        prefix="stage2_eval_vs_tokens")
        log.info("stage2 eval at step %d (%d tokens): ppl %.3f, kl %.4f", state.step, state.tokens_seen,
                 result["ppl"], result.get("kl", float("nan")))
        return record

    def log_step(self, state: TrainState, scalars: dict[str, float], seconds: float) -> None:
        tokens_per_s = self.loader.tokens_per_step / max(seconds, 1e-9)
        record = {"step": state.step, "tokens": state.tokens_seen, "skipped_steps": state.skipped_steps,
                  "tokens_per_s": tokens_per_s, **scalars}
        if self.rank0:
            append_jsonl(self.out_dir / TRAIN_LOG, record)
        if state.step % max(1, self.cfg.logging.log_interval) == 0 or state.step == self.steps:
            tb = {k: scalars[k] for k in ("loss", "kl", "lr", "grad_norm")}
            if self.weights.ce_weight:
                tb["ce"] = scalars["ce"]
            if self.weights.hidden_weight:
                tb["hidden"] = scalars["hidden"]
            tb.update(tokens_seen=state.tokens_seen, tokens_per_s=tokens_per_s,
                      skipped_steps=state.skipped_steps, memory_gb=peak_memory_gb(self.device))
            self.tb.scalars(tb, state.step, prefix="stage2")

    # -- the loop
    def run(self, stop_after: int | None = None) -> Stage2Result:
        state = self.resume()
        guard = NonFiniteGuard(self.cfg.distill.nan_policy, self.cfg.distill.max_skipped, state.skipped_steps)
        ckpt_every = self.cfg.distill.checkpoint_interval
        last_eval, saved_at = None, state.step if state.step else -1
        bar = progress(total=self.steps, initial=state.step, desc="stage2", unit="step",
                       enabled=self.cfg.logging.progress_bar)
        stopped = False
        if state.step == 0 and evaluates_while_training(self.cfg.distill) and self.eval_rows:
            last_eval = self.evaluate(state)  # the starting point of the tokens-to-target curve
        while state.step < self.steps:
            start = time.perf_counter()
            scalars = self.train_step(state, guard)
            state.step += 1
            state.tokens_seen += self.loader.tokens_per_step
            state.skipped_steps = guard.skipped
            self.log_step(state, scalars, time.perf_counter() - start)
            bar.update(1)
            bar.set_postfix(kl=f"{scalars['kl']:.4f}", lr=f"{scalars['lr']:.2e}")
            if is_eval_step(self.cfg.distill, state.step) and self.eval_rows:
                last_eval = self.evaluate(state)
            stopping = stop_after is not None and state.step >= stop_after and state.step < self.steps
            if state.step < self.steps and (signum := stop_requested(self.device)):
                log.info("stage2: %s received: checkpoint at step %d, then stop", signal_name(signum), state.step)
                stopping = True
            if (ckpt_every and state.step % ckpt_every == 0) or stopping or state.step == self.steps:
                self._save(state)
                saved_at = state.step
            faults.maybe_kill("step", state.step)
            if stopping:
                stopped = True
                break
        bar.close()
        if state.step != saved_at:  # a resumed, already finished run: make sure the end state is saved
            self._save(state)
        if not stopped and self.eval_rows and (last_eval is None or last_eval["step"] != state.step):
            last_eval = self.evaluate(state)
        student_state = None if stopped else self.gather_student()
        self.tb.flush()
        return Stage2Result(state.step, state.tokens_seen, state.skipped_steps, stopped, last_eval, student_state)

    def extra_state(self) -> dict[str, torch.Tensor] | None:
        """Tensors DeepSpeed's checkpoint of this engine misses (none for ZeRO engines)."""
        return None

    def restore_extra(self, extra: dict[str, torch.Tensor] | None) -> None:
        pass

    def gather_student(self) -> dict[str, torch.Tensor] | None:
        """The full student state dict on rank 0 (collective; TP shards gathered)."""
        state = gather_full_state(self.engine, self.ctx)
        return None if state is None else restore_vocab_padding(state, self.engine.module)

    def _save(self, state: TrainState) -> None:
        state.data = self.loader.state_dict()
        state.layout = dict(self.layout)
        path = self.manager.save(self.engine, state, self.extra_state())
        log.info("stage2: checkpoint %s", path)


def gather_full_state(engine: Any, ctx: Any = None) -> dict[str, torch.Tensor] | None:
    """The student's full state dict (CPU, fp32) on rank 0, None elsewhere. Collective under ZeRO-3
    and, with a ParallelContext of TP > 1, over the TP group (each shard gathered to its full size,
    so the names and shapes are those of the single-device HybridLM)."""
    from megatron_tc.parallel.tensor_parallel import gather_full, gather_full_state_dict

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tp = ctx is not None and ctx.tp_size > 1
    if engine.zero_optimization_partition_weights():
        import deepspeed

        module = engine.module
        out: dict[str, torch.Tensor] = {}
        # one module's parameters at a time: a rank never holds more than the largest layer unsharded
        for prefix, sub in module.named_modules():
            params = list(sub.named_parameters(recurse=False))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                if rank0 or tp:
                    for name, p in params:
                        value = gather_full(p.detach(), p, ctx) if tp else p.detach()
                        if rank0:
                            out[f"{prefix}.{name}" if prefix else name] = value.float().cpu().clone()
        for name, buf in module.named_buffers():
            if rank0 and name in module.state_dict():
                out[name] = buf.detach().cpu().clone()
        return out if rank0 else None
    state = gather_full_state_dict(engine.module, ctx) if tp else engine.module.state_dict()
    if not rank0:
        return None
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def build_stage2(cfg: Any, ctx: Any, student: nn.Module, teacher: nn.Module, loader: Any, eval_rows: list[torch.Tensor],
                 out_dir: Path, tb: Any, device: torch.device, tensorboard_dir: str | None = None,
                 eval_log: Path | None = None) -> Stage2Trainer:
    """Select the trainable parameters, build the DeepSpeed student engine and the frozen teacher
    (ZeRO over DP, TP inside; with PP > 1 the pipeline engine of stage2_pipeline, TP inside its
    stages) and return a trainer ready to `run()` (which resumes if it can)."""
    from megatron_tc.parallel.deepspeed_engine import build_student_engine, build_teacher

    if student.arch.vocab_size != teacher.arch.vocab_size:
        raise ValueError(f"the student's vocabulary ({student.arch.vocab_size} tokens) differs from the teacher's "
                         f"({teacher.arch.vocab_size}): the KL compares their logits token by token; build the "
                         "student from this teacher (init stage)")
    if ctx.pp_size > 1:
        from megatron_tc.distill.stage2_pipeline import build_pipeline_stage2

        return build_pipeline_stage2(cfg, ctx, student, teacher, loader, out_dir, tb, device, tensorboard_dir, eval_log)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = student.arch.vocab_size
    if ctx.tp_size > 1:
        student, teacher = shard_over_tp(student, teacher, ctx)
    names = select_trainable(student, cfg.distill.stage2.trainable)
    student.set_activation_checkpointing(cfg.parallel.activation_checkpointing)  # ZeRO-3 path; PP has its own
    log.info("stage2: %d trainable tensors (%s), %d steps", len(names), cfg.distill.stage2.trainable,
             total_steps(cfg, loader.tokens_per_step))
    ds_config = stage2_deepspeed_config(cfg, ctx, device, tensorboard_dir, student, teacher,
                                        latest_zero_stage(out_dir / "checkpoints"))
    compiled = resolve_compile(cfg, ctx, device, ds_config["zero_optimization"]["stage"])
    if compiled:
        # the layers of one kind share a compiled graph whose kernels assume 16-byte aligned
        # parameters; ZeRO-1/2 packs them end to end in one flat buffer unless told to pad
        ds_config["zero_optimization"]["parameter_alignment"] = True
    engine = build_student_engine(student, ds_config, ctx)
    if compiled:
        from megatron_tc.model.compile import compile_decoder_layers

        compile_decoder_layers(engine.module)
    if cfg.run.precision == "bf16" and device.type == "cuda":
        teacher = teacher.to(torch.bfloat16)
    teacher = build_teacher(teacher.to(device), ds_config, ctx, cfg.parallel.teacher_mode)
    teacher_compiled = resolve_teacher_compile(cfg, ctx, device, compiled)
    if teacher_compiled:
        from megatron_tc.model.compile import compile_decoder_layers

        compile_decoder_layers(teacher)  # in place: the caller's teacher module runs compiled from here on
    trainer = Stage2Trainer(cfg, ctx, engine, teacher, loader, eval_rows, out_dir, tb, device, vocab_size, eval_log)
    trainer.compiled, trainer.teacher_compiled = compiled, teacher_compiled
    trainer.layout["param_aligned"] = int(compiled)  # a resume must pad parameters the same way
    return trainer
