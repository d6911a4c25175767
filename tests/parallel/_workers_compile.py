"""Workers for stage 2 with the student's decoder layers compiled (`parallel.compile`): one gloo
rank, the layers traced with the "aot_eager" backend (inductor's code generation runs on GPUs)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.parallel._workers_distill import SEQ, packed, teacher_and_student, tiny_config, zipf_tokens


def run_stage(out: Path, compile_setting: str, steps: int = 3) -> dict:
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.stage2 import build_stage2
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(1, 1)
    cfg = tiny_config(out, steps, **{"parallel__zero_stage": "1", "parallel__compile": compile_setting,
                                     "distill__eval_interval": "2"})
    teacher, student = teacher_and_student(0)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    eval_ids = torch.from_numpy(zipf_tokens(np.random.default_rng(2), (2, SEQ)))
    tb = TBWriter(out / "tb")
    trainer = build_stage2(cfg, ctx, student, teacher, loader, window_rows([eval_ids]), out, tb, torch.device("cpu"))
    with trainer:
        from megatron_tc.model.compile import is_compiled

        info = {"compiled": trainer.compiled, "aligned": trainer.engine.zero_parameter_alignment(),
                "layers_compiled": [is_compiled(layer) for layer in trainer.engine.module.layers]}
        result = trainer.run()
    tb.close()
    assert result.steps == steps
    torch.save(result.student_state, out / "student.pt")
    return info


def eager_and_compiled(rank: int, world_size: int, root: str) -> None:
    import megatron_tc.model.compile as compile_module

    real = compile_module.compile_decoder_layers
    compile_module.compile_decoder_layers = lambda model: real(model, backend="aot_eager")
    info = {name: run_stage(Path(root) / name, name) for name in ("false", "true")}
    (Path(root) / "info.json").write_text(json.dumps(info))
