"""Checkpoints of the distillation stages: atomic writes, a kill while writing, resume, pruning.

The kill test runs real processes: a one-rank DeepSpeed ZeRO-3 job saves at steps 2, 4 and 6 and
is SIGKILLed (fault injection) while writing step 4, after the engine files and state.json are in
the temporary directory but before the rename. The restarted job must ignore and delete that
directory, resume from step 2 and end with the weights of a job that was never killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_tc.distill.checkpointing import CheckpointError, CheckpointManager, TrainState, atomic_write_text
from megatron_tc.testing import free_port

JOB = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from megatron_tc.distill.checkpointing import CheckpointManager, TrainState
    from megatron_tc.parallel.deepspeed_engine import avoid_cpu_shm_build
    import deepspeed

    root, port = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
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
    print("RESULT " + json.dumps({"losses": losses, "weights": weights}), flush=True)
    dist.destroy_process_group()  # a gloo group left to interpreter exit can abort it ("terminate called ...")
""")


def run_job(root: Path, faults: str = "") -> subprocess.CompletedProcess:
    root.parent.mkdir(parents=True, exist_ok=True)
    script = root.parent / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_TC_FAULTS=faults, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return subprocess.run([sys.executable, str(script), str(root), str(free_port())], env=env,
                          capture_output=True, text=True, timeout=240)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path):
    straight = result(run_job(tmp_path / "straight" / "ckpt"))

    root = tmp_path / "killed" / "ckpt"
    killed = run_job(root, faults="kill@checkpoint:4")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert (root / "latest").read_text().strip() == "step_00000002"
    half = root / ".tmp-step_00000004"
    assert (half / "state.json").is_file() and not (root / "step_00000004").exists()

    resumed = result(run_job(root))
    assert not half.exists()  # the half-written checkpoint was cleaned up
    assert resumed["losses"] == straight["losses"][2:]  # steps 3..6, bit for bit
    assert resumed["weights"] == straight["weights"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]

    # a damaged partition is named, and refused before the engine loads anything
    optim = next((root / "step_00000006" / "engine").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:-100])
    damaged = run_job(root)
    assert damaged.returncode != 0
    assert "CheckpointError" in damaged.stderr and f"{optim} has" in damaged.stderr and "truncated" in damaged.stderr


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
