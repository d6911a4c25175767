"""parallel.zero_stage=auto on 2 gloo ranks: the tiny student fits, so the pipeline trains it under
ZeRO-0 (on CPU ranks: nothing partitioned); ZeRO-3 trains the same way."""
import json

import torch

from megatron_tc.testing import run_distributed
from tests.parallel import _workers_zero_choice
from tests.parallel._workers_distill import teacher_and_student


def _losses(run) -> torch.Tensor:
    lines = (run / "train_log.jsonl").read_text().splitlines()
    return torch.tensor([json.loads(line)["loss"] for line in lines], dtype=torch.float64)


def test_auto_picks_zero0_on_cpu_and_trains_as_zero3(tmp_path):
    """Same data, same initial weights, 3 steps each: step losses within 1e-6 relative, and each
    tensor's update (final - initial) within 1% of its norm: the two stages reduce the gradients
    in another order, and AdamW turns that into small update differences where a gradient is ~0."""
    run_distributed(_workers_zero_choice.auto_and_zero3, 2, str(tmp_path), timeout=240)
    assert json.loads((tmp_path / "stages.json").read_text()) == {"auto": 0, "3": 3}
    auto, zero3 = _losses(tmp_path / "auto"), _losses(tmp_path / "3")
    assert len(auto) == 3
    torch.testing.assert_close(auto, zero3, rtol=1e-6, atol=0)
    got, want = torch.load(tmp_path / "auto/student.pt"), torch.load(tmp_path / "3/student.pt")
    initial = teacher_and_student(0)[1].state_dict()
    assert got.keys() == want.keys() == initial.keys()
    for name, value in want.items():
        step_auto, step_zero3 = got[name] - initial[name], value - initial[name]
        assert step_zero3.norm() > 0, f"{name} was not trained"
        assert (step_auto - step_zero3).norm() <= 0.01 * step_zero3.norm(), name
