"""Workers for tests/parallel/test_pipeline.py: PP=2 distillation on DeepSpeed's pipeline engine
== one process."""
from __future__ import annotations

import copy

import torch

from megatron_tc.config import deepspeed_template_path
from megatron_tc.model import HybridLM
from megatron_tc.parallel import pipeline as pipe
from megatron_tc.parallel.deepspeed_engine import build_deepspeed_config
from megatron_tc.parallel.state import destroy_parallel, init_parallel
from tests.parallel._workers_common import (VOCAB, ReferenceAdamW, assert_close, assert_same_weights, batches, on,
                                            place, tiny_arch)

STEPS, MICRO, BATCH, SEQ = 5, 2, 2, 16
LR, CLIP, TEMPERATURE, CE_WEIGHT = 2e-3, 0.5, 2.0, 0.5

# (tied embeddings, partition, activation checkpointing): between them every pipeline path
SETUPS = [(False, "pattern", False), (True, "parameters", True)]


def models(tied: bool) -> tuple[HybridLM, HybridLM]:
    arch = tiny_arch("AGG|GAG", tie_embeddings=tied)  # 6 layers: stage 0 and 1 get three each by pattern
    torch.manual_seed(0)
    teacher = HybridLM(arch.with_pattern("AAA|AAA"), init_std=0.2)
    student = HybridLM(arch, init_std=0.2)
    return student, teacher


def single_process_run(tied: bool, data, loss_fn, device: str = "cpu",
                       dtype: torch.dtype = torch.float32) -> tuple[list[float], HybridLM]:
    student, teacher = (place(m, device, dtype) for m in models(tied))
    teacher.requires_grad_(False)
    opt = ReferenceAdamW(student.parameters(), lr=LR, clip=CLIP)
    losses = []
    for step in data:
        total = 0.0
        for ids, labels in on(device, step):
            (ids, pos, doc), labels = pipe.pipeline_batch(ids, labels)
            with torch.no_grad():
                teacher_logits = teacher(ids, pos, doc)
            loss = loss_fn((student(ids, pos, doc), pipe.pack(teacher_logits)), labels) / len(step)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, student


def pp_run(ctx, tied: bool, partition: str, checkpointing: bool, data, device: str = "cpu",
           dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor], HybridLM]:
    """STEPS pipeline steps; returns (step losses, the weights this stage trained, the teacher)."""
    student, teacher = (place(m, device, dtype) for m in models(tied))
    cfg = build_deepspeed_config(zero_stage=1, micro_batch_size=BATCH, global_batch_size=BATCH * MICRO,
                                 dp_size=ctx.dp_size, lr=LR, betas=(0.9, 0.95), grad_clip=CLIP, pipeline=True,
                                 bf16=dtype == torch.bfloat16, base=deepspeed_template_path(ctx.pp_size))
    loss_fn = pipe.DistillLoss(VOCAB, TEMPERATURE, CE_WEIGHT, tp_group=ctx.tp_group)
    engine = pipe.build_pipeline_engine(student, teacher, cfg, ctx, loss_fn, partition, checkpointing)
    assert engine.num_stages == 2 and engine.stage_id == ctx.pp_rank
    if partition == "pattern":  # 2 embeddings + 3 layers | 3 layers + norms + head
        assert engine.module.parts == [0, 5, 10], engine.module.parts
    losses = [engine.train_batch(pipe.pipeline_batches(step)).item() for step in data]
    # The stage's modules are the student's own objects: the ones this stage trained.
    local = {id(p) for p in engine.module.parameters()}
    trained = {n: p.detach() for n, p in student.named_parameters() if id(p) in local}
    assert trained, f"stage {ctx.pp_rank} trained nothing"
    assert all(p.device.type == torch.device(device).type for p in trained.values())
    return losses, trained, teacher


def check_setup(ctx, tied: bool, partition: str, checkpointing: bool) -> None:
    data = batches(STEPS, MICRO, BATCH, SEQ)
    loss_fn = pipe.DistillLoss(VOCAB, TEMPERATURE, CE_WEIGHT, tp_group=None)
    want_losses, reference = single_process_run(tied, data, loss_fn)
    losses, trained, teacher = pp_run(ctx, tied, partition, checkpointing, data)
    what = f"PP=2 tied={tied} partition={partition} checkpointing={checkpointing}"
    for got, want in zip(losses, want_losses):
        assert_close(torch.tensor(got), torch.tensor(want), f"{what} step loss")
    want = {n: p.detach() for n, p in reference.named_parameters() if n in trained}
    assert_same_weights(trained, want, f"{what} stage {ctx.pp_rank}")
    if ctx.is_first_stage:
        assert "embed_tokens.weight" in trained and "layers.0.mixer.q_proj.weight" in trained
    if ctx.is_last_stage:
        assert "norm.weight" in trained and (tied or "lm_head.weight" in trained)
    assert not any(p.requires_grad or p.grad is not None for p in teacher.parameters()), "teacher got gradients"


def pp2_matches_single_process(rank: int, world_size: int) -> None:
    ctx = init_parallel(tp=1, pp=2)
    try:
        assert (ctx.pp_size, ctx.dp_size) == (2, 1)
        for tied, partition, checkpointing in SETUPS:
            check_setup(ctx, tied, partition, checkpointing)
    finally:
        destroy_parallel()


def tp2_pp2_gradients_match_single_process(rank: int, world_size: int) -> None:
    """4 processes, TP=2 x PP=2: tied vocab-parallel head across stages, DeepSpeed's partitioned
    activations and gradients between stages, activation checkpointing. The gradients that reach
    the optimizer (captured before its step) == single-process gradients. (Weights after AdamW
    steps are no good measure here: AdamW's first step is lr * sign(g), so an element whose
    gradient is ~1e-9 flips with fp32 rounding.)"""
    from megatron_tc.parallel.tensor_parallel import apply_tensor_parallel, gather_full

    ctx = init_parallel(tp=2, pp=2)
    try:
        arch = tiny_arch("AGG|GAG", tp=2, tie_embeddings=True, qk_norm=True)
        torch.manual_seed(0)
        teacher, student = HybridLM(arch.with_pattern("AAA|AAA")), HybridLM(arch)
        reference, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
        apply_tensor_parallel(student, ctx)
        apply_tensor_parallel(teacher, ctx)
        cfg = build_deepspeed_config(zero_stage=0, micro_batch_size=BATCH, global_batch_size=BATCH * MICRO,
                                     dp_size=ctx.dp_size, grad_clip=0.0, pipeline=True,
                                     base=deepspeed_template_path(ctx.pp_size))
        assert cfg["pipeline"]["pipe_partitioned"] and cfg["pipeline"]["grad_partitioned"]
        loss_fn = pipe.DistillLoss(VOCAB, TEMPERATURE, CE_WEIGHT, tp_group=ctx.tp_group)
        engine = pipe.build_pipeline_engine(student, teacher, cfg, ctx, loss_fn, "pattern", True)
        names = {id(p): n for n, p in student.named_parameters()}
        got = {}

        def capture(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    got[names[id(p)]] = gather_full(p.grad.detach().clone(), p, ctx)

        engine.optimizer.register_step_pre_hook(capture)
        step = batches(1, MICRO, BATCH, SEQ)[0]
        engine.train_batch(pipe.pipeline_batches(step))

        ref_teacher.requires_grad_(False)
        for ids, labels in step:
            (ids, pos, doc), labels = pipe.pipeline_batch(ids, labels)
            with torch.no_grad():
                teacher_logits = ref_teacher(ids, pos, doc)
            (pipe.DistillLoss(VOCAB, TEMPERATURE, CE_WEIGHT)((reference(ids, pos, doc), pipe.pack(teacher_logits)),
                                                             labels) / len(step)).backward()
        want = {n: p.grad for n, p in reference.named_parameters() if n in got}
        assert "embed_tokens.weight" in got and len(got) > 10, sorted(got)
        assert_same_weights(got, want, f"TP=2 x PP=2 gradients, stage {ctx.pp_rank}")
    finally:
        destroy_parallel()
