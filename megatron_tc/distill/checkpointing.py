"""Resumable training checkpoints: DeepSpeed engine state plus the pipeline's own, written atomically.

Layout under a stage's checkpoint root (e.g. ``<run_dir>/stage2/checkpoints``)::

    step_00000040/
        engine/...            engine.save_checkpoint(tag="engine"): ZeRO partitions, optimizer
        rng/rank_00000.pt     python / numpy / torch (and CUDA) RNG states of each rank
        extra/rank_00000.pt   tensors the engine's own checkpoint misses (optional, per rank)
        files.json            size and sha256 of every file above (verified before anything loads)
        state.json            TrainState: step, tokens seen, data position, counters, layout
    latest                    text file naming the newest complete step directory
    .tmp-step_00000060/       a checkpoint being written (or half-written by a killed job)

A checkpoint is written into a ``.tmp-`` directory; rank 0 renames it to its final name only after
every rank has finished, and writes ``latest`` (tmp file + rename) last. A job killed at any moment
therefore leaves ``latest`` pointing at a complete checkpoint; leftover ``.tmp-`` directories are
deleted when the next job starts. Before a resume touches the engine, every file is checked against
files.json (size, sha256; the hashing is spread over the ranks), so a truncated or corrupted
partition is named and nothing is partially loaded. The root must be on a file system every rank sees (as for
DeepSpeed and Megatron-LM checkpoints).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_tc.distill import faults

LATEST = "latest"
ENGINE_TAG = "engine"
STATE_FILE = "state.json"
FILES = "files.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (missing files, another layout)."""


@dataclass
class TrainState:
    """Everything besides the engine that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps taken (skipped non-finite steps included)
    tokens_seen: int = 0  # training tokens consumed over all data-parallel ranks
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient
    data: dict[str, Any] = field(default_factory=dict)  # the sampler's state_dict()
    layout: dict[str, int] = field(default_factory=dict)  # world_size, tp, pp, dp, zero when written
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. best eval so far

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        return cls(**json.loads(text))


# ---- small atomic file helpers ---------------------------------------------------------------

def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def hash_files(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256}} of every file under `root`, the hashing dealt over ranks."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in (STATE_FILE, FILES))
    rank, world = _world()
    mine = {n: {"size": (root / n).stat().st_size, "sha256": _sha256(root / n)} for n in names[rank::world]}
    merged: dict[str, dict[str, Any]] = {}
    for part in _gather(mine):
        merged.update(part)
    return merged


def verify_files(path: Path, expected: dict[str, dict[str, Any]]) -> list[str]:
    """Problems (one line per file) of checkpoint `path` against its files.json; [] when intact."""
    names = sorted(expected)
    rank, world = _world()
    problems = []
    for name in names[rank::world]:
        file, want = path / name, expected[name]
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != want["size"]:
            problems.append(f"{file} has {file.stat().st_size} bytes, {FILES} says {want['size']}: truncated")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{file} is corrupted: sha256 differs from {FILES}")
    return sorted(p for part in _gather(problems) for p in part)


# ---- RNG ---------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the manager -------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Save, find, load and prune checkpoints under `root`. Every method is collective."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the latest checkpoint is always kept")
        self.root = Path(root)
        self.keep_last = keep_last
        self.loaded_extra: dict[str, torch.Tensor] | None = None

    # -- queries
    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(steps)

    def latest(self) -> Path | None:
        """The directory `latest` names, or None when no checkpoint was ever completed."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not _STEP_DIR.match(name) or not (path / STATE_FILE).is_file():
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a complete checkpoint (no {path / STATE_FILE}); "
                f"complete ones here: {[step_dir_name(s) for s in self.complete_steps()] or 'none'}. "
                f"Point {pointer} at one of them, or delete {self.root} to start over.")
        return path

    # -- writing
    def clean_partial(self) -> list[Path]:
        """Delete half-written checkpoints (rank 0) and return what was removed."""
        removed: list[Path] = []
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp-") or (p.name.startswith(f".{LATEST}.tmp")):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                    removed.append(p)
        _barrier()
        return removed

    def save(self, engine: Any, state: TrainState, extra: dict[str, torch.Tensor] | None = None) -> Path:
        """Write a checkpoint of `engine` (a DeepSpeed engine) and `state`; return its directory.

        extra: this rank's tensors that DeepSpeed's checkpoint does not hold (e.g. the pipeline
        engine skips tied layers); `load` hands them back in `self.loaded_extra`."""
        name = step_dir_name(state.step)
        tmp, final = self.root / f".tmp-{name}", self.root / name
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, save_latest=False)
        _atomic_torch_save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
        if extra is not None:
            (tmp / "extra").mkdir(exist_ok=True)
            _atomic_torch_save({k: v.detach().cpu() for k, v in extra.items()}, tmp / "extra" / f"rank_{_rank():05d}.pt")
        _barrier()
        files = hash_files(tmp)
        if _rank() == 0:
            atomic_write_text(tmp / FILES, json.dumps(files, indent=1, sort_keys=True))
            atomic_write_text(tmp / STATE_FILE, state.to_json())
            faults.maybe_kill("checkpoint", state.step)  # test hook: die before the rename
            if final.exists():  # the same step saved again (e.g. a forced final save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            atomic_write_text(self.root / LATEST, name + "\n")
            self._prune(keep=final)
        _barrier()
        return final

    def _prune(self, keep: Path) -> None:
        steps = self.complete_steps()
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            path = self.root / step_dir_name(step)
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # -- reading
    @staticmethod
    def _read_state(path: Path) -> TrainState:
        file = path / STATE_FILE
        try:
            return TrainState.from_json(file.read_text())
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{file} cannot be read ({err}); the checkpoint is damaged: point "
                                  f"{path.parent / LATEST} at an older step_* directory, or delete it") from None

    @staticmethod
    def _verify(path: Path) -> list[str]:
        listing = path / FILES
        if not listing.is_file():  # written by an older version: nothing to verify against
            return []
        try:
            expected = json.loads(listing.read_text())
        except (OSError, ValueError) as err:
            return [f"{listing} cannot be read ({err})"]
        return verify_files(path, expected)

    def load(self, engine: Any, layout: dict[str, int], load_optimizer: bool = True) -> TrainState | None:
        """Restore `engine`, this rank's RNG and the train state from `latest`; None if there is none.

        `layout` (world_size, tp, pp, dp, zero): the job's. A checkpoint written with another
        data-parallel size (same tp, pp=1) is loaded through a DeepSpeed universal checkpoint
        (`load_universal`; ZeRO-0 states are whole on every rank and load as they are); the ZeRO
        stage may change only between 1 and 2 (`check_same_zero_format`); the data position is
        global (the sampler's step), so the run continues on the same batches.
        """
        self.clean_partial()
        path = self.latest()
        if path is None:
            return None
        state = self._read_state(path)
        check_same_padding(path, state.layout, layout)
        resharded = bool(state.layout) and any(state.layout.get(k) != layout.get(k) for k in RESHARD_KEYS)
        if resharded:
            check_dp_reshard(path, state.layout, layout)
        # a rank the saving job did not have continues from rank 0's RNG streams
        rng_rank = _rank() if not resharded or _rank() < state.layout.get("world_size", 1) else 0
        rng_file = path / "rng" / f"rank_{rng_rank:05d}.pt"
        missing_rng = [] if rng_file.is_file() else [f"{rng_file} is missing"]
        problems = sorted(set(self._verify(path) + [p for part in _gather(missing_rng) for p in part]))
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged, nothing was loaded:\n  " + "\n  ".join(problems)
                                  + f"\nPoint {self.root / LATEST} at an older step_* directory, or delete it.")
        check_same_zero_format(path, state.layout, engine.zero_optimization_stage())
        if resharded and engine.zero_optimization_stage() > 0:  # ZeRO-0 states are whole on every rank
            load_path = load_universal(engine, path, state.layout, layout, load_optimizer)
        else:
            load_path, _ = engine.load_checkpoint(str(path), tag=ENGINE_TAG, load_optimizer_states=load_optimizer,
                                                  load_lr_scheduler_states=load_optimizer, load_module_strict=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no engine checkpoint under {path / ENGINE_TAG}; "
                                  "the checkpoint is incomplete: delete it and point `latest` at an older one")
        set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy state inside
        if resharded:
            state.layout = dict(layout)
        extra_file = path / "extra" / f"rank_{_rank():05d}.pt"
        self.loaded_extra = torch.load(extra_file, weights_only=True) if extra_file.is_file() else None
        _barrier()
        return state


# ---- resuming on another data-parallel size ---------------------------------------------------------

UNIVERSAL_TAG = "universal"
RESHARD_KEYS = ("world_size", "tp", "pp", "dp")


def check_same_padding(path: Path, saved: dict[str, int], now: dict[str, int]) -> None:
    """A compiled stage 2 pads ZeRO's flat parameter buffer (`param_aligned` in the layout) and
    DeepSpeed cannot load a padded checkpoint into an unpadded engine or the reverse."""
    was, is_now = bool(saved.get("param_aligned", 0)), bool(now.get("param_aligned", 0))
    if saved and was != is_now:
        raise CheckpointError(
            f"{path} was written with the student's layers {'compiled' if was else 'eager'} (ZeRO parameters "
            f"{'padded' if was else 'unpadded'}) but this job runs them {'compiled' if is_now else 'eager'}: resume "
            f"with parallel.compile={'true' if was else 'false'}, or start a new run directory")


def latest_zero_stage(root: str | os.PathLike) -> int | None:
    """The ZeRO stage the latest checkpoint under `root` was written with; None when there is none
    or it records none (it is then checked when it loads)."""
    try:
        path = CheckpointManager(root).latest()
        layout = CheckpointManager._read_state(path).layout if path is not None else {}
    except CheckpointError:
        return None
    return int(layout["zero"]) if "zero" in layout else None


def zero_format(stage: int) -> str:
    """How a ZeRO stage lays out its engine checkpoint: 'whole' (0: the optimizer state beside the
    weights), 'optimizer' (1 and 2: one file of partitioned optimizer state per rank, the same
    for both), 'parameters' (3: the parameters partitioned too)."""
    return "whole" if stage == 0 else "parameters" if stage == 3 else "optimizer"


def saved_zero_format(path: Path, saved: dict[str, int]) -> str:
    """`zero_format` of the engine that wrote checkpoint `path`: its recorded stage, or for a
    checkpoint that records none, read from DeepSpeed's file names."""
    if "zero" in saved:
        return zero_format(int(saved["zero"]))
    names = [p.name for p in (path / ENGINE_TAG).glob("*.pt")]
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return "parameters"
    return "optimizer" if any(n.endswith("_optim_states.pt") for n in names) else "whole"


def check_same_zero_format(path: Path, saved: dict[str, int], now_stage: int) -> None:
    """ZeRO-1 and 2 load each other's checkpoints; DeepSpeed loads no other change of stage (not
    through a universal checkpoint either): refused before anything loads. (`parallel.zero_stage=auto`
    may pick another stage than the run's first job did when the memory estimate changes, e.g. on
    another kind of GPU.)"""
    saved_format = saved_zero_format(path, saved)
    if saved_format != zero_format(now_stage):
        stages = {"whole": "0", "optimizer": "1 or 2", "parameters": "3"}
        raise CheckpointError(
            f"{path} was written by a ZeRO-{stages[saved_format]} engine but this job's engine runs ZeRO-{now_stage}, "
            f"and DeepSpeed cannot load one into the other: resume with "
            f"parallel.zero_stage={stages[saved_format].split()[0]}, or start a new run directory")


def check_dp_reshard(path: Path, saved: dict[str, int], now: dict[str, int]) -> None:
    """Only the data-parallel size may change between save and resume (TP and PP shards need
    tools/reshard.py on the exported student, not a training checkpoint)."""
    fixed = {k: (saved.get(k), now.get(k)) for k in ("tp", "pp") if saved.get(k) != now.get(k)}
    if fixed or now.get("pp", 1) != 1:
        raise CheckpointError(
            f"{path} was written with layout {saved} but this job has {now}; a training checkpoint resumes on "
            "another data-parallel size only (same parallel.tp, parallel.pp=1): resume with the same tp/pp, "
            "or start a new run directory")


def universal_checkpoint(path: Path) -> Path:
    """`path`'s engine checkpoint as a DeepSpeed universal checkpoint (`path`/universal), written
    once by rank 0 with DeepSpeed's ds_to_universal and reused by later resumes. Collective."""
    from megatron_tc.parallel.state import shared_outcome

    out = path / UNIVERSAL_TAG
    shared_outcome(_write_universal(path, out) if _rank() == 0 and not (out / "zero").is_dir() else None)
    return out


def _write_universal(path: Path, out: Path) -> Callable[[], None]:
    """Rank 0's conversion of `path`'s engine checkpoint into `out` (written aside, then renamed)."""

    def write() -> None:
        import contextlib
        import io
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tmp = path / f".tmp-{UNIVERSAL_TAG}"
        shutil.rmtree(tmp, ignore_errors=True)
        args = Namespace(input_folder=str(path / ENGINE_TAG), output_folder=str(tmp), num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines; errors still raise
            ds_to_universal(args)
        os.replace(tmp, out)
        _fsync_dir(path)

    return write


def load_universal(engine: Any, path: Path, saved: dict[str, int], now: dict[str, int],
                   load_optimizer: bool) -> str | None:
    """Restore `engine` (this job's data-parallel size) from checkpoint `path` written with another
    one, through DeepSpeed's universal checkpoint (parameters and Adam moments re-partitioned)."""
    from megatron_tc.monitor import get_logger

    get_logger(__name__).info("resuming %s (data-parallel size %d) with data-parallel size %d through a DeepSpeed "
                              "universal checkpoint", path, saved.get("dp", 0), now.get("dp", 0))
    universal_checkpoint(path)
    config = engine._config  # DeepSpeed reads the flag at load time; the engine was built without it
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(str(path), tag=UNIVERSAL_TAG, load_optimizer_states=load_optimizer,
                                              load_lr_scheduler_states=load_optimizer, load_module_strict=True)
    finally:
        config.load_universal_checkpoint = before
    return load_path


def load_or_init(manager: CheckpointManager, engine: Any, layout: dict[str, int],
                 on_resume: Callable[[TrainState], None] | None = None) -> TrainState:
    """The state to start from: resumed from the latest checkpoint, else a fresh one."""
    state = manager.load(engine, layout)
    if state is None:
        return TrainState(layout=dict(layout))
    if on_resume is not None:
        on_resume(state)
    return state
