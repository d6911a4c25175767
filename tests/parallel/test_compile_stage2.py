"""Stage 2 with `parallel.compile=true` trains as the eager student does: the same step losses,
evaluation scores and updates (fp32, CPU), with ZeRO's parameters padded to 16-byte
boundaries for the compiled kernels."""
import json

import torch

from megatron_tc.testing import run_distributed
from tests.parallel import _workers_compile
from tests.parallel._workers_distill import teacher_and_student


def _log(run, name: str, key: str) -> torch.Tensor:
    lines = (run / name).read_text().splitlines()
    return torch.tensor([json.loads(line)[key] for line in lines], dtype=torch.float64)


def test_compiled_layers_train_as_the_eager_student(tmp_path):
    run_distributed(_workers_compile.eager_and_compiled, 1, str(tmp_path), timeout=240)
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["false"] == {"compiled": False, "aligned": False, "layers_compiled": [False] * 4}
    assert info["true"] == {"compiled": True, "aligned": True, "layers_compiled": [True] * 4}
    eager, compiled = tmp_path / "false", tmp_path / "true"
    torch.testing.assert_close(_log(compiled, "train_log.jsonl", "loss"), _log(eager, "train_log.jsonl", "loss"),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(_log(compiled, "eval_log.jsonl", "kl"), _log(eager, "eval_log.jsonl", "kl"),
                               rtol=1e-5, atol=0)
    got, want = torch.load(compiled / "student.pt"), torch.load(eager / "student.pt")
    initial = teacher_and_student(0)[1].state_dict()
    assert got.keys() == want.keys() == initial.keys()
    for name, value in want.items():  # AdamW turns rounding-level gradient differences into small update ones
        step_compiled, step_eager = got[name] - initial[name], value - initial[name]
        assert step_eager.norm() > 0, f"{name} was not trained"
        assert (step_compiled - step_eager).norm() <= 0.01 * step_eager.norm(), name
