"""Workers for tests/parallel/test_zero3.py: ZeRO-3 over DP=2 == one process."""
from __future__ import annotations

import json

import torch

from megatron_tc.config import deepspeed_template_path
from megatron_tc.model import HybridLM
from megatron_tc.parallel import deepspeed_engine as dse
from megatron_tc.parallel.losses import vocab_parallel_kl
from megatron_tc.parallel.state import destroy_parallel, init_parallel
from tests.parallel._workers_common import (VOCAB, ReferenceAdamW, assert_close, assert_same_weights, batches, on,
                                            assert_no_live_engines, place, tiny_arch)

STEPS, GLOBAL_BATCH, SEQ = 5, 4, 16
LR, CLIP, TEMPERATURE = 2e-3, 0.5, 2.0


def models(tp: int = 1) -> tuple[HybridLM, HybridLM]:
    """A hybrid student (both layer kinds, GQA, tied) and an all-attention teacher."""
    arch = tiny_arch("AGGA", tp=tp, tie_embeddings=True, qk_norm=tp > 1)
    torch.manual_seed(0)
    teacher = HybridLM(arch.with_pattern("AAAA"), init_std=0.2)
    student = HybridLM(arch, init_std=0.2)
    return student, teacher


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    return vocab_parallel_kl(student_logits, teacher_logits, VOCAB, TEMPERATURE, tp_group).mean()


def single_process_run(data, device: str = "cpu", dtype: torch.dtype = torch.float32,
                       tp: int = 1) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The reference: AdamW with gradient clipping over the whole global batch (`ReferenceAdamW`)."""
    student, teacher = (place(m, device, dtype) for m in models(tp))
    teacher.requires_grad_(False)
    opt = ReferenceAdamW(student.parameters(), lr=LR, clip=CLIP)
    losses, clipped = [], 0
    for step in data:
        total = 0.0
        for ids, _labels in on(device, step):
            with torch.no_grad():
                teacher_logits = teacher(ids)
            loss = kl_loss(student(ids), teacher_logits) / len(step)
            loss.backward()
            total += loss.item()
        clipped += int(opt.step() > CLIP)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in student.state_dict().items()}, clipped / len(data)


def zero3_run(ctx, data, device: str = "cpu", dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """ZeRO-3 over ctx's DP group (TP inside when ctx.tp_size > 1): step losses (averaged over the
    global batch) and the final full student state dict, on every rank."""
    import deepspeed
    import torch.distributed as dist

    from megatron_tc.parallel.tensor_parallel import apply_tensor_parallel, gather_full

    student, teacher = (apply_tensor_parallel(place(m, device, dtype), ctx) for m in models(ctx.tp_size))
    student.set_activation_checkpointing(activation_checkpointing)
    recomputed = []
    student.layers[0].mixer.register_forward_hook(lambda *_: recomputed.append(torch.is_grad_enabled()))
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    # the shipped template, with persistence off: this tiny model's tensors would otherwise all
    # stay whole on every rank (below stage3_param_persistence_threshold) and nothing be sharded
    base = json.loads(deepspeed_template_path(1).read_text())
    base["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg = dse.build_deepspeed_config(zero_stage=3, micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
                                     dp_size=ctx.dp_size, lr=LR, betas=(0.9, 0.95), grad_clip=CLIP, base=base,
                                     bf16=dtype == torch.bfloat16)
    engine = dse.build_student_engine(student, cfg, ctx)
    teacher_engine = dse.build_teacher(teacher, cfg, ctx, mode="engine")
    for what, eng in (("student", engine), ("teacher", teacher_engine)):
        sharded = [p for p in eng.module.parameters() if p.ds_tensor.numel() < p.ds_numel]
        assert len(sharded) == len(list(eng.module.parameters())), f"ZeRO-3 left {what} tensors whole"
    assert engine.zero_optimization_stage() == 3 and teacher_engine.zero_optimization_stage() == 3
    assert type(teacher_engine.optimizer).__name__ == "DeepSpeedZeRoOffload", "teacher engine must have no optimizer"

    losses = []
    for step in data:
        mine = step[ctx.dp_rank::ctx.dp_size]  # this rank's share of the global batch
        total = torch.zeros((), device=device)  # NCCL reduces device tensors only
        for ids, _labels in on(device, mine):
            with torch.no_grad():
                teacher_logits = teacher_engine(ids)
            loss = kl_loss(engine(ids), teacher_logits, ctx.tp_group)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / len(step)
            dse.assert_no_grads(teacher_engine)
        dist.all_reduce(total, group=ctx.dp_group)
        losses.append(total.item())
    assert engine.global_steps == len(data)
    forwards = sum(len(step[ctx.dp_rank::ctx.dp_size]) for step in data)
    assert len(recomputed) == forwards * (2 if activation_checkpointing else 1), "layer 0 ran an unexpected number of times"

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = dict(engine.module.named_parameters())
        state = {k: gather_full(v.detach(), params[k], ctx).clone() if k in params else v.detach().clone()
                 for k, v in engine.module.state_dict().items()}
    with deepspeed.zero.GatheredParameters(list(teacher_engine.module.parameters())):
        for name, value in teacher_engine.module.state_dict().items():
            assert torch.equal(value, teacher_before[name]), f"teacher weight {name} changed"
    dse.release_engine(engine)
    dse.release_engine(teacher_engine)
    return losses, state


def zero3_matches_single_process(rank: int, world_size: int, activation_checkpointing: bool = False) -> None:
    data = batches(STEPS, GLOBAL_BATCH, 1, SEQ)  # per step: GLOBAL_BATCH micro-batches of one sequence
    want_losses, want_state, clipped = single_process_run(data)
    assert clipped > 0, "the reference never clipped: gradient clipping would go untested"

    ctx = init_parallel(tp=1, pp=1)
    try:
        assert ctx.dp_size == 2
        losses, got_state = zero3_run(ctx, data, activation_checkpointing=activation_checkpointing)
        assert_no_live_engines()  # the student's (ZeRO-3 optimizer) and the teacher's (inference) engine
        for got, want in zip(losses, want_losses):
            assert_close(torch.tensor(got), torch.tensor(want), "ZeRO-3 step loss")
        assert_same_weights(got_state, want_state, "ZeRO-3 final")
    finally:
        destroy_parallel()


def zero3_with_activation_checkpointing_matches_single_process(rank: int, world_size: int) -> None:
    """The reference runs without checkpointing; ZeRO-3 recomputes every student layer in backward."""
    zero3_matches_single_process(rank, world_size, activation_checkpointing=True)
