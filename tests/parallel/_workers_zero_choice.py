"""Workers for the data-parallel engine choice: stage 2 on 2 gloo ranks under the stage
`parallel.zero_stage=auto` picks (ZeRO-1 for the tiny models) and under ZeRO-3."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.parallel._workers_distill import SEQ, packed, teacher_and_student, tiny_config, zipf_tokens


def run_stage(out: Path, stage: str, steps: int = 3) -> int:
    """Stage 2 for `steps` steps with parallel.zero_stage=`stage`; returns DeepSpeed's stage."""
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.stage2 import build_stage2
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(1, 1)
    cfg = tiny_config(out, steps, **{"parallel__zero_stage": stage, "distill__eval_interval": "0"})
    teacher, student = teacher_and_student(0)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    eval_ids = torch.from_numpy(zipf_tokens(np.random.default_rng(2), (2, SEQ)))
    tb = TBWriter(out / "tb")
    trainer = build_stage2(cfg, ctx, student, teacher, loader, window_rows([eval_ids]), out, tb, torch.device("cpu"))
    with trainer:
        used = trainer.engine.zero_optimization_stage()
        result = trainer.run()
    tb.close()
    assert result.steps == steps
    if ctx.rank == 0:
        torch.save(result.student_state, out / "student.pt")
    return used


def auto_and_zero3(rank: int, world_size: int, root: str) -> None:
    """auto, then 3; the stage each engine ran with goes to <root>/stages.json."""
    stages = {name: run_stage(Path(root) / name, name) for name in ("auto", "3")}
    if rank == 0:
        (Path(root) / "stages.json").write_text(json.dumps(stages))
