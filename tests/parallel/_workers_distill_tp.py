"""Workers for tests/parallel/test_distill_tp.py: stage 2 with tensor parallelism (TP=2, DP=1,
ZeRO-3 through mpu) against the same run with TP=1 on one process.

The tiny teacher/student pair, packed documents and config of _workers_distill (hybrid AGAG student,
GQA: 4 query heads, 2 KV heads), with the CE and hidden-state terms on so that every loss path runs
on vocabulary shards, and the teacher padded to 256 vocabulary rows while the student has 96 (as
after the init stage). Each run saves its train log, eval log and gathered student to `out`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.parallel._workers_distill import SEQ, packed, teacher_and_student, tiny_config, zipf_tokens

STEPS = 4
EXTRA = {"distill__stage2__ce_weight": "0.5", "distill__stage2__hidden_weight": "0.1"}


def padded_teacher(teacher):
    """The teacher with 256 vocabulary rows (96 real), as a converted checkpoint would be, while the
    student keeps 96: stage 2 under TP must bring both to one padding before comparing shards."""
    from megatron_tc.convert.layout import resize_vocab
    from megatron_tc.model.transformer import HybridLM

    state, arch = resize_vocab(teacher.state_dict(), teacher.arch, 256)
    padded = HybridLM(arch)
    padded.load_state_dict(state)
    return padded


def run_stage2(out: Path, tp: int, steps: int = STEPS, stop_after: int | None = None, teacher_ckpt: Path | None = None):
    """teacher_ckpt: a checkpoint of the padded teacher, loaded split over the TP ranks
    (parallel.sharded_teacher) instead of sharding the in-memory teacher."""
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.stage2 import build_stage2
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(tp, 1)
    cfg = tiny_config(out, steps, parallel__tp=str(tp), **EXTRA)
    teacher, student = teacher_and_student(0)
    teacher = padded_teacher(teacher)
    if teacher_ckpt is not None:
        from megatron_tc.parallel.sharded_teacher import load_tensor_parallel

        teacher = load_tensor_parallel(teacher_ckpt, ctx)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    eval_ids = torch.from_numpy(zipf_tokens(np.random.default_rng(2), (4, SEQ)))
    tb = TBWriter(out / "tb")
    trainer = build_stage2(cfg, ctx, student, teacher, loader, window_rows([eval_ids]), out, tb, torch.device("cpu"))
    with trainer:
        result = trainer.run(stop_after=stop_after)
    tb.close()
    if result.student_state is not None:
        torch.save(result.student_state, out / "student.pt")
    return result


def run_stage1(out: Path, tp: int, steps: int = 3, teacher_ckpt: Path | None = None) -> None:
    """Stage 1 (the GDN mixers of layers 1 and 3 aligned to the teacher's attention outputs); the
    merged student goes to out/student.pt. teacher_ckpt: as in run_stage2."""
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.stage1 import build_stage1, merged_student_state
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(tp, 1)
    cfg = tiny_config(out, STEPS, parallel__tp=str(tp), distill__stage1__steps=str(steps),
                      distill__stage1__lr="1.0e-2")
    teacher, student = teacher_and_student(0)
    teacher = padded_teacher(teacher)
    if teacher_ckpt is not None:
        from megatron_tc.parallel.sharded_teacher import load_tensor_parallel

        teacher = load_tensor_parallel(teacher_ckpt, ctx)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    tb = TBWriter(out / "tb")
    trainer, _ = build_stage1(cfg, ctx, student, teacher, loader, [1, 3], out, tb, torch.device("cpu"))
    with trainer:
        state, stopped = trainer.run()
        assert state.step == steps and not stopped
        merged = merged_student_state(student, trainer)
    tb.close()
    if merged is not None:
        torch.save(merged, out / "student.pt")


def single_process(rank: int, world_size: int, root: str) -> None:
    run_stage1(Path(root) / "s1_tp1", tp=1)
    run_stage2(Path(root) / "tp1", tp=1)


def tensor_parallel(rank: int, world_size: int, root: str) -> None:
    """TP=2 straight, then TP=2 stopped after 2 steps and resumed by a fresh job (same process)."""
    from megatron_tc.parallel.state import destroy_parallel

    root = Path(root)
    run_stage1(root / "s1_tp2", tp=2)
    result = run_stage2(root / "tp2", tp=2)
    assert (result.student_state is None) == (rank != 0)
    first = run_stage2(root / "tp2_split", tp=2, stop_after=2)
    assert first.stopped_early and first.steps == 2
    run_stage2(root / "tp2_split", tp=2)
    destroy_parallel()


def stage1_bf16_with_fp32_teacher(rank: int, world_size: int, root: str) -> None:
    """run.precision=bf16: the engine's mixers are bf16 while stage 1's teacher stays fp32 (its
    targets keep full precision), so the captured inputs must be cast to the engine's dtype
    (a crash on the first GPU smoke run). bf16 is switched on for CUDA only, so the
    engine's config is forced to bf16 here: DeepSpeed's bf16 ZeRO runs on CPU too."""
    import megatron_tc.distill.stage2_setup as stage2_module
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.stage1 import build_stage1
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import destroy_parallel, init_parallel

    out = Path(root)
    ctx = init_parallel(1, 1)
    cfg = tiny_config(out, STEPS, run__precision="bf16", distill__stage1__steps="2")
    cuda_config = stage2_module.stage2_deepspeed_config
    stage2_module.stage2_deepspeed_config = lambda *args, **kwargs: {**cuda_config(*args, **kwargs),
                                                                     "bf16": {"enabled": True}}
    teacher, student = teacher_and_student(0)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    tb = TBWriter(out / "tb")
    trainer, _ = build_stage1(cfg, ctx, student, teacher, loader, [1, 3], out, tb, torch.device("cpu"))
    assert next(trainer.engine.module.parameters()).dtype == torch.bfloat16
    assert next(teacher.parameters()).dtype == torch.float32
    with trainer:
        state, stopped = trainer.run()
    tb.close()
    assert state.step == 2 and not stopped and state.skipped_steps == 0
    destroy_parallel()
