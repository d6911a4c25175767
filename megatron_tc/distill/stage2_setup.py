"""Stage 2's engine set-up: the ZeRO stage (`parallel.zero_stage`, 'auto' from the memory
estimate), the student's DeepSpeed config, compiled decoder layers (`parallel.compile`), and the
tensor-parallel split of student and teacher with the vocabulary padding it needs. Used by stage 1,
stage 2 and pretraining (`distill.stage2.build_stage2` puts them together)."""
from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from megatron_tc.monitor import get_logger

log = get_logger(__name__)


def resolve_zero_stage(cfg: Any, ctx: Any, device: torch.device, trainable: torch.nn.Module | None,
                       teacher: torch.nn.Module | None = None, resume_stage: int | None = None) -> int:
    """parallel.zero_stage, with 'auto' decided by `parallel.memory.choose_zero_stage` from the
    student (`trainable`), the teacher and the micro-batch; the decision is logged on rank 0.
    resume_stage: the stage of the checkpoint the job resumes (`checkpointing.latest_zero_stage`):
    'auto' keeps it when it fits, since a checkpoint loads only under the stage that wrote it."""
    from megatron_tc.parallel.memory import (
        CPU_ZERO_STAGES, HEADROOM, ZERO_STAGES, ZeroChoice, choose_zero_stage, footprint_of, least_device_memory,
    )

    stage = cfg.parallel.zero_stage
    if stage != "auto":
        return stage
    if ctx.pp_size > 1:
        return 1  # DeepSpeed's pipeline engine runs ZeRO 0 or 1 only
    if trainable is None:  # nothing to estimate from: the stage that fits the most (none helps one rank)
        return 3 if ctx.dp_size > 1 else 1
    footprint = footprint_of(
        trainable, teacher, tokens=cfg.data.micro_batch_size * cfg.data.seq_len,
        bf16=device.type == "cuda" and cfg.run.precision == "bf16",
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        teacher_partitioned=cfg.parallel.teacher_mode == "engine")
    stages = CPU_ZERO_STAGES if device.type == "cpu" else ZERO_STAGES
    choice = choose_zero_stage(footprint, ctx.dp_size, least_device_memory(device), stages=stages)
    if resume_stage in stages and resume_stage != choice.stage:
        kept = ZeroChoice(resume_stage, True, footprint.bytes_per_rank(resume_stage, ctx.dp_size), choice.device_bytes)
        if kept.estimate["total"] <= HEADROOM * choice.device_bytes:
            if ctx.rank == 0:
                log.info("parallel.zero_stage=auto over %d data-parallel rank(s): ZeRO-%d, the stage of the checkpoint "
                         "it resumes (%s)", ctx.dp_size, resume_stage, kept.describe())
            return resume_stage
    if ctx.rank == 0:
        (log.info if choice.fits else log.warning)(
            "parallel.zero_stage=auto over %d data-parallel rank(s): %s (set parallel.zero_stage to override)",
            ctx.dp_size, choice.describe())
    return choice.stage


def stage2_deepspeed_config(cfg: Any, ctx: Any, device: torch.device, tensorboard_dir: str | None,
                            trainable: torch.nn.Module | None = None, teacher: torch.nn.Module | None = None,
                            resume_stage: int | None = None) -> dict:
    """The student's DeepSpeed config: the template (the built-in one or parallel.deepspeed_config) with its
    "auto" values filled from our config (ZeRO's bucket sizes from the `trainable` module's
    parameters with requires_grad; the ZeRO stage from `resolve_zero_stage`), plus DeepSpeed's own
    TensorBoard monitor."""
    from megatron_tc.config import deepspeed_template_path
    from megatron_tc.parallel.deepspeed_engine import build_deepspeed_config

    s2 = cfg.distill.stage2
    ds = build_deepspeed_config(
        zero_stage=resolve_zero_stage(cfg, ctx, device, trainable, teacher, resume_stage),
        micro_batch_size=cfg.data.micro_batch_size,
        global_batch_size=cfg.data.global_batch_size, dp_size=ctx.dp_size,
        bf16=device.type == "cuda" and cfg.run.precision == "bf16", lr=s2.lr, weight_decay=s2.weight_decay,
        grad_clip=s2.grad_clip, pipeline=ctx.pp_size > 1,
        base=deepspeed_template_path(ctx.pp_size, cfg.parallel.deepspeed_config),
        trainable_numel=None if trainable is None else sum(p.numel() for p in trainable.parameters() if p.requires_grad),
        device_type=device.type)
    # DeepSpeed's default ZeRO-3 leaf classes are Hugging Face MoE blocks, which our models never
    # contain; an empty list skips the walk over the model that looks for them.
    ds.setdefault("zero_optimization", {}).setdefault("leaf_module", {"classes": []})
    explicit = cfg.parallel.zero_stage != "auto"  # auto never partitions over one rank
    if ds["zero_optimization"].get("stage") == 3 and ctx.dp_size == 1 and ctx.rank == 0 and explicit:
        log.warning("ZeRO-3 over one data-parallel rank shards nothing, yet gathers and releases every layer's "
                    "parameters each step (host time: docs/benchmarks.md); parallel.zero_stage=1 "
                    "trains the same way without them")
    optimizer = ds.get("optimizer", {})
    params = optimizer.setdefault("params", {})
    if (params.get("torch_adam") and optimizer.get("type", "").lower() in ("adam", "adamw")
            and "fused" not in params and "foreach" not in params
            and ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") == "none"):
        # PyTorch's fused AdamW: one pass over ZeRO's flat fp32 partition instead of a dozen. On a
        # CPU the other paths also make full-size temporaries, fresh memory every step (the plain
        # anchor loop's optimizer step on 2 cores: 0.85 s foreach, 0.30 s fused). Its values differ
        # from theirs by fp32 rounding.
        params["fused"] = True
    if tensorboard_dir is not None:
        ds["tensorboard"] = {"enabled": True, "output_path": str(tensorboard_dir), "job_name": "deepspeed"}
    return ds


def shard_over_tp(student: nn.Module, teacher: nn.Module, ctx: Any) -> tuple[nn.Module, nn.Module]:
    """Both models tensor-parallel (megatron-core layers, shards of the full weights every rank
    holds); their logits are then vocabulary shards, which the losses and the evaluation reduce
    over the TP group."""
    from megatron_tc.model.config import pad_vocab
    from megatron_tc.parallel.tensor_parallel import TensorParallelHybridLM, apply_tensor_parallel

    if isinstance(teacher, TensorParallelHybridLM):  # loaded split (parallel.shard_teacher): only the student
        if student.arch.padded_vocab_size != teacher.arch.padded_vocab_size:
            set_vocab_padding(student, teacher.arch.padded_vocab_size)
        return apply_tensor_parallel(student, ctx), teacher
    # the teacher is sharded as a copy: the caller's (the run context's cached teacher) stays whole
    # for the stages that score it on one device (eval)
    teacher = copy.deepcopy(teacher)
    s_pad, t_pad = student.arch.padded_vocab_size, teacher.arch.padded_vocab_size
    if s_pad != t_pad or s_pad % ctx.tp_size:
        # logits are compared shard by shard, so both need one padding that TP divides (students
        # are saved padded for tp=1, the converted teacher for parallel.tp)
        padded = pad_vocab(student.arch.vocab_size, ctx.tp_size)
        set_vocab_padding(student, padded)
        set_vocab_padding(teacher, padded)
    return apply_tensor_parallel(student, ctx), apply_tensor_parallel(teacher, ctx)


def set_vocab_padding(model: nn.Module, padded: int) -> None:
    """Resize a single-device HybridLM's embedding (and untied LM head) to `padded` rows, in place:
    the real rows are kept, rows past vocab_size are zero (they never produce logits)."""
    import dataclasses

    vocab = model.arch.vocab_size
    if padded < vocab:
        raise ValueError(f"padded vocabulary {padded} < vocab_size {vocab}")
    for name in ("embed_tokens", "lm_head"):
        module = getattr(model, name, None)
        if module is None:
            continue
        old = module.weight
        weight = old.new_zeros(padded, old.shape[1])
        with torch.no_grad():
            weight[:vocab] = old[:vocab]
        module.weight = nn.Parameter(weight, requires_grad=old.requires_grad)
        if isinstance(module, nn.Embedding):
            module.num_embeddings = padded
        else:
            module.out_features = padded
    if not hasattr(model, "saved_padded_vocab_size"):
        model.saved_padded_vocab_size = model.arch.padded_vocab_size  # restored in the gathered state
    model.arch = dataclasses.replace(model.arch, padded_vocab_size=padded)


def restore_vocab_padding(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A gathered state of a model whose padding `set_vocab_padding` changed, with the vocabulary
    tables back at the model's original row count (so it loads into the original architecture)."""
    padded = getattr(model, "saved_padded_vocab_size", None)
    if padded is None:
        return state
    vocab = model.arch.vocab_size
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in state:
            table = state[name][:vocab]
            state[name] = torch.cat([table, table.new_zeros(padded - vocab, table.shape[1])])
    return state


def resolve_compile(cfg: Any, ctx: Any, device: torch.device, zero_stage: int) -> bool:
    """Whether stage 2 compiles the student's decoder layers (`parallel.compile`, docs/parallelism.md):
    'auto' on CUDA where `config.checks.compile_blocker` finds nothing in the way and the model's
    blocks are not switched to eager (MEGATRON_TC_COMPILE=0); true everywhere it can; logged."""
    from megatron_tc.config.checks import compile_blocker

    setting = cfg.parallel.compile
    blocker = compile_blocker(zero_stage, ctx.pp_size, ctx.tp_size, cfg.parallel.activation_checkpointing)
    if setting is True and blocker is not None:
        raise ValueError(f"parallel.compile=true cannot be combined with {blocker}; set parallel.compile=auto "
                         "(compiles where it can) or false")
    eager = os.environ.get("MEGATRON_TC_COMPILE", "1") == "0"
    chosen = setting is True or (setting == "auto" and device.type == "cuda" and blocker is None and not eager)
    if ctx.rank == 0:
        reason = "" if chosen or setting is False else f" ({blocker or ('MEGATRON_TC_COMPILE=0' if eager else 'CPU')})"
        log.info("parallel.compile=%s: student decoder layers %s%s", str(setting).lower(),
                 "compiled one by one" if chosen else "eager", reason)
    return chosen


def resolve_teacher_compile(cfg: Any, ctx: Any, device: torch.device, student_compiled: bool) -> bool:
    """Whether stage 2 compiles the frozen teacher's decoder layers (`parallel.compile_teacher`):
    'auto' when the student's layers are compiled (`resolve_compile`) and the teacher is a plain module
    per rank; true wherever `config.checks.teacher_compile_blocker` finds nothing in the way; logged.
    The teacher runs under no_grad: its graphs are forward-only, its norms, rotary embedding and MLP
    gate fused between the matmuls as the student's are."""
    from megatron_tc.config.checks import teacher_compile_blocker

    setting = cfg.parallel.compile_teacher
    blocker = teacher_compile_blocker(cfg.parallel.teacher_mode, ctx.pp_size, ctx.tp_size)
    if setting is True and blocker is not None:
        raise ValueError(f"parallel.compile_teacher=true cannot be combined with {blocker}; set "
                         "parallel.compile_teacher=auto (compiles where it can) or false")
    chosen = setting is True or (setting == "auto" and student_compiled and blocker is None)
    if ctx.rank == 0:
        reason = ""
        if not chosen and setting == "auto":
            reason = f" ({blocker or 'the student layers are eager'})"
        log.info("parallel.compile_teacher=%s: teacher decoder layers %s%s", str(setting).lower(),
                 "compiled one by one" if chosen else "eager", reason)
    return chosen
