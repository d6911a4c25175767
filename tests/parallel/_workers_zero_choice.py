"""Workers for the data-parallel engine choice: stage 2 on 2 gloo ranks under the stage
`parallel.zero_stage=auto` picks (ZeRO-0 for the tiny models on CPU ranks) and under ZeRO-3."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.parallel._workers_distill import build_tiny_stage2


def run_stage(out: Path, stage: str, steps: int = 3) -> int:
    """Stage 2 for `steps` steps with parallel.zero_stage=`stage`; returns DeepSpeed's stage."""
    ctx, trainer, tb = build_tiny_stage2(out, steps, eval_windows=2, parallel__zero_stage=stage,
                                         distill__eval_interval="0")
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
