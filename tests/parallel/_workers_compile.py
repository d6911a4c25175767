"""Workers for stage 2 with the student's decoder layers compiled (`parallel.compile`): one gloo
rank, the layers traced with the "aot_eager" backend (inductor's code generation runs on GPUs)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.parallel._workers_distill import build_tiny_stage2


def run_stage(out: Path, compile_setting: str, steps: int = 3) -> dict:
    _, trainer, tb = build_tiny_stage2(out, steps, eval_windows=2, parallel__zero_stage="1",
                                       parallel__compile=compile_setting, distill__eval_interval="2")
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
