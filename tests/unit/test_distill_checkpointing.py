"""Checkpoints of the distillation stages: atomic writes, a kill while writing, resume, pruning.

The kill test runs real processes (forked gloo ranks): a one-rank DeepSpeed ZeRO-3 job saves at steps 2, 4 and 6 and
is SIGKILLed (fault injection) while writing step 4, after the engine files and state.json are in
the temporary directory but before the rename. The restarted job must ignore and delete that
directory, resume from step 2 and end with the weights of a job that was never killed.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from megatron_tc.distill.checkpointing import CheckpointError, CheckpointManager, TrainState, atomic_write_text
from megatron_tc.testing import run_distributed

def checkpoint_job(rank: int, world_size: int, root: str) -> None:
    """One rank of a ZeRO-3 job that checkpoints at steps 2, 4 and 6 (resuming from `root` when it
    holds one); writes its losses and final weights to <root>.result.json."""
    import deepspeed
    import torch

    from megatron_tc.parallel.deepspeed_engine import avoid_cpu_shm_build

    avoid_cpu_shm_build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    manager = CheckpointManager(root, keep_last=2)
    state = manager.load(engine, {"world_size": 1}) or TrainState(layout={"world_size": 1})
    losses = []
    while state.step < 6:
        g = torch.Generator().manual_seed(state.step)
        x = torch.randn(2, 6, generator=g) + 0.01 * torch.randn(2, 6)  # global RNG: restored on resume
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        state.step += 1
        if state.step % 2 == 0:
            manager.save(engine, state)
    from deepspeed.utils import safe_get_full_fp32_param
    weights = [safe_get_full_fp32_param(p).flatten().tolist() for p in engine.module.parameters()]
    Path(f"{root}.result.json").write_text(json.dumps({"losses": losses, "weights": weights}))


def run_job(root: Path, monkeypatch, faults: str = "") -> dict:
    """The job on one gloo rank of the test harness: a real process (forked from its server), so a
    SIGKILL fault kills it like any run; returns its result."""
    root.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("MEGATRON_TC_FAULTS", faults)
    run_distributed(checkpoint_job, 1, str(root), timeout=240)
    return json.loads(Path(f"{root}.result.json").read_text())


def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, monkeypatch):
    straight = run_job(tmp_path / "straight" / "ckpt", monkeypatch)

    root = tmp_path / "killed" / "ckpt"
    with pytest.raises(AssertionError, match=rf"rank 0 exited with code -{int(signal.SIGKILL)} without"):
        run_job(root, monkeypatch, faults="kill@checkpoint:4")
    assert (root / "latest").read_text().strip() == "step_00000002"
    half = root / ".tmp-step_00000004"
    assert (half / "state.json").is_file() and not (root / "step_00000004").exists()

    resumed = run_job(root, monkeypatch)
    assert not half.exists()  # the half-written checkpoint was cleaned up
    assert resumed["losses"] == straight["losses"][2:]  # steps 3..6, bit for bit
    assert resumed["weights"] == straight["weights"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]

    # a damaged partition is named, and refused before the engine loads anything
    optim = next((root / "step_00000006" / "engine").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-100])
    with pytest.raises(AssertionError, match="rank 0 raised") as damaged:
        run_job(root, monkeypatch)
    report = str(damaged.value)
    assert "CheckpointError" in report and f"{optim} has" in report and "truncated" in report


def test_latest_pointing_at_an_incomplete_checkpoint_is_refused_with_the_file_named(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None
    (tmp_path / "step_00000002").mkdir()
    atomic_write_text(tmp_path / "step_00000002" / "state.json", TrainState(step=2).to_json())
    atomic_write_text(tmp_path / "latest", "step_00000004\n")
    with pytest.raises(CheckpointError, match=r"latest names 'step_00000004'.*step_00000002"):
        manager.latest()
    atomic_write_text(tmp_path / "latest", "step_00000002\n")
    assert manager.latest() == tmp_path / "step_00000002"


def test_train_state_round_trips_and_keep_last_must_be_positive():
    state = TrainState(step=7, tokens_seen=1792, skipped_steps=1, data={"step": 7, "seed": 3},
                       layout={"world_size": 2, "tp": 1, "pp": 1, "dp": 2})
    assert TrainState.from_json(state.to_json()) == state
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("/nonexistent", keep_last=0)


@pytest.mark.parametrize("saved, now, fix", [(1, 0, "parallel.compile=true"), (0, 1, "parallel.compile=false")])
def test_a_checkpoint_padded_for_compiled_layers_resumes_only_with_the_same_padding(tmp_path, saved, now, fix):
    layout = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}
    (tmp_path / "step_00000002").mkdir()
    atomic_write_text(tmp_path / "step_00000002" / "state.json",
                      TrainState(step=2, layout={**layout, "param_aligned": saved}).to_json())
    atomic_write_text(tmp_path / "latest", "step_00000002\n")
    manager = CheckpointManager(tmp_path, keep_last=2)
    with pytest.raises(CheckpointError, match=f"step_00000002 was written .* resume with {fix}"):
        manager.load(engine=None, layout={**layout, "param_aligned": now})
