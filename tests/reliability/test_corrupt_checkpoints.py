"""Corrupted, truncated, missing and mismatched files: a clear error naming the file, raised before
anything is loaded. megatron_tc checkpoints (teacher / students, sha256 manifest) and stage-2
training checkpoints (DeepSpeed engine state + the pipeline's own)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.errors import CheckpointError
from megatron_tc.convert.lazy import SafetensorsFile
from tests.reliability._rundir import Job, checkpoints, teacher_and_student

LAST = ckpt.shard_filename(1, 1)  # the last file load_shards reads


# ---- megatron_tc checkpoints --------------------------------------------------------------------

@pytest.fixture()
def sharded(template, tmp_path) -> Path:
    """The tiny teacher (with its tokenizer) as a TP=2 x PP=2 checkpoint (4 shards), plus another
    checkpoint next to it."""
    teacher, student = teacher_and_student()
    tokenizer = {p.name: p.read_bytes() for p in (template / "tokenizer").iterdir() if p.is_file()}
    ckpt.save_checkpoint(student.state_dict(), student.arch, tmp_path / "other", 2, 2)
    return ckpt.save_checkpoint(teacher.state_dict(), teacher.arch, tmp_path / "teacher", 2, 2,
                                tokenizer_files=tokenizer)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


FAULTS = {
    # name: (damage(checkpoint dir), regex the error must match, deserialized files allowed)
    "missing shard": (lambda d: os.remove(d / LAST), rf"{LAST} is missing", 0),
    "truncated shard": (lambda d: (d / LAST).write_bytes((d / LAST).read_bytes()[:-64]),
                        rf"{LAST} has \d+ bytes, manifest.json says \d+: the file is truncated", 0),
    "flipped byte": (lambda d: _flip_byte(d / LAST), rf"{LAST} is corrupted: sha256", 0),
    "shard of another rank": (lambda d: shutil.copyfile(d / ckpt.shard_filename(0, 1), d / LAST), LAST, 0),
    "shard of another checkpoint": (lambda d: shutil.copyfile(d.parent / "other" / LAST, d / LAST), LAST, 0),
    "manifest of another checkpoint": (lambda d: shutil.copyfile(d.parent / "other/manifest.json", d / "manifest.json"),
                                       "config.json", 0),
    "shard not in manifest": (lambda d: _edit_json(d / "manifest.json", lambda m: m["files"].pop(LAST)),
                              rf"{LAST} is not listed in .*manifest.json", 0),
    "manifest tensor list differs": (
        lambda d: _edit_json(d / "manifest.json", lambda m: m["files"][LAST]["tensors"].popitem()),
        rf"{LAST}: tensors do not match manifest.json", 4),
    "config.json edited": (lambda d: _edit_json(d / "config.json", lambda c: c["arch"].update(num_layers=5)),
                           "config.json", 0),
    "tokenizer file corrupted": (lambda d: (d / "tokenizer/tokenizer.json").write_bytes(b"{ }"), "tokenizer.json", 0),
    "manifest unreadable": (lambda d: (d / "manifest.json").write_text('{"files": {'), "manifest.json is corrupted", 0),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_damaged_checkpoint_is_named_and_nothing_is_loaded(sharded, fault, monkeypatch):
    damage, message, allowed_loads = FAULTS[fault]
    damage(sharded)
    loads = []
    real_read = SafetensorsFile.read  # every tensor read of a checkpoint goes through it
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, *a: loads.append(self.path) or real_read(self, *a))
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    with pytest.raises(CheckpointError, match=message) as err:
        load_hybrid_lm(sharded)
    assert str(sharded) in str(err.value)  # the full path, not only a file name
    assert len(loads) <= allowed_loads, f"deserialized {loads} before the damage was detected"


@pytest.mark.parametrize("damaged", [LAST, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"])
def test_teacher_loader_verifies_weights_and_tokenizer_before_using_them(sharded, damaged):
    """The pipeline's teacher loader (calibrate.teacher_io.load_teacher) refuses a damaged shard or
    tokenizer file with the checkpoint's error, naming the file."""
    from megatron_tc.calibrate.teacher_io import load_teacher

    path = sharded / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{damaged}.* has \d+ bytes"):
        load_teacher(sharded)


# ---- stage-2 training checkpoints -----------------------------------------------------------------

class UntouchableEngine:
    """Stands in for the DeepSpeed engine where the checkpoint must be refused before it is used."""

    def load_checkpoint(self, *args, **kwargs):
        raise AssertionError("the engine was loaded from a checkpoint that should have been refused first")


@pytest.fixture()
def train_ckpts(reference, tmp_path) -> Path:
    """A copy of the reference run's checkpoint directory (latest = step 12, step 10 kept)."""
    return Path(shutil.copytree(checkpoints(reference()), tmp_path / "checkpoints"))


LAYOUT = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}


def test_latest_naming_a_missing_checkpoint_is_refused_before_loading(train_ckpts):
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError, CheckpointManager

    shutil.rmtree(train_ckpts / "step_00000012")
    with pytest.raises(TrainCheckpointError, match=r"latest names 'step_00000012'.*complete ones here: \['step_00000010'\]"):
        CheckpointManager(train_ckpts).load(UntouchableEngine(), LAYOUT)


def test_checkpoint_of_another_tensor_parallel_layout_is_refused_before_loading(train_ckpts):
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError, CheckpointManager

    with pytest.raises(TrainCheckpointError, match=r"written with layout .* but this job has .*data-parallel size only"):
        CheckpointManager(train_ckpts).load(UntouchableEngine(), dict(LAYOUT, world_size=2, tp=2))


def test_truncated_train_state_is_named(train_ckpts):
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError, CheckpointManager

    state = train_ckpts / "step_00000012/state.json"
    state.write_text(state.read_text()[:40])
    with pytest.raises(TrainCheckpointError, match="state.json"):
        CheckpointManager(train_ckpts).load(UntouchableEngine(), LAYOUT)


def test_missing_rng_file_is_refused_before_the_engine_is_loaded(train_ckpts):
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError, CheckpointManager

    os.remove(train_ckpts / "step_00000012/rng/rank_00000.pt")
    with pytest.raises(TrainCheckpointError, match="rank_00000.pt"):
        CheckpointManager(train_ckpts).load(UntouchableEngine(), LAYOUT)


def _engine_file(step_dir: Path, kind: str) -> Path:
    return next((step_dir / "engine").rglob(f"*{kind}_states.pt"))


TRAIN_FAULTS = {
    # name: (damage(step dir, older step dir) -> the damaged file, regex after the file name)
    "flipped byte in the optimizer partition": (lambda d, o: _flip(_engine_file(d, "optim")), "is corrupted: sha256"),
    "model states of the older step": (lambda d, o: _swap(_engine_file(o, "model"), _engine_file(d, "model")),
                                       "(is corrupted|has \\d+ bytes)"),
    "model states deleted": (lambda d, o: _delete(_engine_file(d, "model")), "is missing"),
    "files.json unreadable": (lambda d, o: _write(d / "files.json", "{"), "cannot be read"),
}


def _flip(path: Path) -> Path:
    _flip_byte(path)
    return path


def _swap(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def _delete(path: Path) -> Path:
    path.unlink()
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("fault", list(TRAIN_FAULTS))
def test_damaged_training_checkpoint_is_named_before_the_engine_loads(train_ckpts, fault):
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError, CheckpointManager

    damage, message = TRAIN_FAULTS[fault]
    damaged = damage(train_ckpts / "step_00000012", train_ckpts / "step_00000010")
    with pytest.raises(TrainCheckpointError, match=rf"{damaged} {message}"):
        CheckpointManager(train_ckpts).load(UntouchableEngine(), LAYOUT)


@pytest.fixture(scope="module")
def corrupted_resume(reference, tmp_path_factory):
    """The finished reference run with half of its latest optimizer partition cut off, continued to
    more steps by the same command (a real subprocess)."""
    base = tmp_path_factory.mktemp("corrupt")
    shutil.copytree(reference() / "run", base / "run")
    # the same teacher and text files (paths are part of the stages' fingerprints: other ones would
    # make stage 2 start over instead of resuming), another run directory
    config = json.loads((reference() / "run.yaml").read_text())
    config["run"]["run_dir"] = str(base / "run")
    (base / "run.yaml").write_text(json.dumps(config))
    engine_dir = checkpoints(base) / "step_00000012/engine"
    optim = next(engine_dir.glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    job = Job(base, "distill.stage2.steps=14", name="corrupt")
    job.wait()
    return base, job, optim


def test_corrupted_engine_file_stops_the_resume_and_writes_nothing(corrupted_resume):
    base, job, _ = corrupted_resume
    assert job.proc.returncode not in (0, None), job.output()[-3000:]
    manifest = json.loads((base / "run/manifest.json").read_text())
    assert manifest["stages"]["stage2"]["status"] == "failed"
    assert (checkpoints(base) / "latest").read_text().strip() == "step_00000012"
    assert sorted(p.name for p in checkpoints(base).iterdir()) == ["latest", "step_00000010", "step_00000012"]


def test_corrupted_engine_file_is_named(corrupted_resume):
    _, job, optim = corrupted_resume
    lines = [line for line in job.output().splitlines() if line.startswith("error on rank 0: checkpoint ")]
    assert lines and "Traceback" not in job.output(), job.output()[-3000:]
    assert optim.name in job.output().split("error on rank 0: checkpoint ")[-1]
