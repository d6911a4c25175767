"""The run directory: where each pipeline stage reads and writes, and the run manifest.

    <run_dir>/
      config.yaml            the resolved config of the last invocation
      manifest.json          per stage: status, config fingerprint, outputs, seconds, finish time
      data_manifest.json     which documents are calibration / training / evaluation (data package)
      teacher/               convert: the teacher as a megatron_tc checkpoint
      select/selection.json  select: the layers kept as attention (+ the policy's scores)
      stats/stats.pt         stats: Taylor statistics of the converted layers
      init/student/          init: the zero-shot student (megatron_tc checkpoint) + report
      stage1/                stage 1: checkpoints/, train_log.jsonl, student/
      stage2/                stage 2: checkpoints/, train_log.jsonl, student/
      eval_log.jsonl         stage 2's periodic evaluation (tokens-to-target format), run.json
      eval/results.json      eval: the final table (also results.md)
      export/hf, export/megatron_tc
      tensorboard/

A stage is complete when the manifest says so with the fingerprint of the config keys it depends
on (chained with the stages before it) and its outputs exist; complete stages are skipped unless
forced. Only rank 0 writes the manifest (atomically).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_tc.distill.checkpointing import atomic_write_text

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class RunPaths:
    root: Path
    tensorboard: Path
    export: Path

    @classmethod
    def from_config(cls, cfg: Any) -> "RunPaths":
        root = Path(cfg.run.run_dir)
        tb = Path(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard_dir else root / "tensorboard"
        export = Path(cfg.export.out_dir) if cfg.export.out_dir else root / "export"
        return cls(root, tb, export)

    @property
    def teacher(self) -> Path: return self.root / "teacher"
    @property
    def selection(self) -> Path: return self.root / "select" / "selection.json"
    @property
    def stats(self) -> Path: return self.root / "stats" / "stats.pt"
    @property
    def init_student(self) -> Path: return self.root / "init" / "student"
    @property
    def naive_student(self) -> Path: return self.root / "init" / "naive"
    def stage_dir(self, stage: str) -> Path: return self.root / stage
    def student(self, stage: str) -> Path: return self.root / stage / "student"
    @property
    def eval_log(self) -> Path: return self.root / "eval_log.jsonl"
    @property
    def results(self) -> Path: return self.root / "eval" / "results.json"


# The student's GDN options (model.gdn_*) and their defaults.
STUDENT_DEFAULTS = {"model.gdn_conv_size": 0, "model.gdn_expand_kv": True, "model.gdn_b_bias": True,
                    "model.gdn_chunk_size": 64}
STUDENT_KEYS = tuple(STUDENT_DEFAULTS)

# Config keys each stage's output depends on (prefixes of dotted keys).
STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "pretrain": ("pretrain", "model.teacher", "data", "run.seed", "run.precision"),
    "convert": ("model.teacher", "model.teacher_format", "model.dtype", "model.make_vocab_size_divisible_by"),
    # select (ar / ga / readout_gap) and stats read calibration rows in data.calib_order and seed
    # the readout fits' default GDN parameters with run.seed; the readout sums run the student's
    # GDN layers (model.gdn_*)
    "select": ("model.layer_pattern", "model.policy", "model.keep_fraction", "model.keep_count", "model.keep_layers",
               "data.source", "data.token_store", "data.split", "data.tokenizer", "data.seq_len",
               "data.calib_tokens", "data.calib_order", "data.bos", "calibrate.stats_chunk_size", "run.seed",
               *STUDENT_KEYS),
    "stats": ("data.source", "data.token_store", "data.split", "data.tokenizer", "data.seq_len", "data.calib_tokens", "data.bos",
              "data.calib_order", "calibrate.init", "calibrate.stats_chunk_size", "run.seed", *STUDENT_KEYS),
    "init": ("calibrate", "model.gdn_conv_size", "model.gdn_expand_kv", "model.gdn_b_bias", "model.gdn_chunk_size",
             "run.seed"),
    "stage1": ("distill.stage1", "distill.stage2.tokens", "data", "run.seed", "run.precision"),
    "stage2": ("distill", "data", "run.seed", "run.precision"),
    "eval": ("eval", "data.source", "data.token_store", "data.split", "data.eval_tokens", "data.seq_len", "data.bos"),
    "export": ("export", "parallel.tp", "parallel.pp"),
}


# keys that joined a stage's list later: while unset they stay out of the payload, so the run
# directories written before them keep their fingerprints
UNSET_LEFT_OUT = frozenset({"data.token_store"})
# the same for keys at these values (what the stage computed with before it read them)
LEFT_OUT_AT = {"select": STUDENT_DEFAULTS, "stats": STUDENT_DEFAULTS}


def _select(tree: dict[str, Any], prefix: str) -> Any:
    node: Any = tree
    for part in prefix.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _without_unset(prefix: str, node: Any) -> Any:
    """`node` (the config under `prefix`) without the UNSET_LEFT_OUT keys below it that are None."""
    if not isinstance(node, dict):
        return node
    return {k: _without_unset(f"{prefix}.{k}", v) for k, v in node.items()
            if not (f"{prefix}.{k}" in UNSET_LEFT_OUT and v is None)}


def stage_fingerprints(config_dict: dict[str, Any], stages: list[str]) -> dict[str, str]:
    """sha256 per stage over its config keys and the fingerprint of the stage before it."""
    out: dict[str, str] = {}
    previous = ""
    for stage in stages:
        left_out = LEFT_OUT_AT.get(stage, {})
        payload = {key: _without_unset(key, _select(config_dict, key)) for key in STAGE_KEYS[stage]
                   if not (key in UNSET_LEFT_OUT and _select(config_dict, key) is None)
                   and not (key in left_out and _select(config_dict, key) == left_out[key])}
        digest = hashlib.sha256(json.dumps([previous, payload], sort_keys=True, default=str).encode()).hexdigest()
        out[stage] = previous = digest[:16]
    return out


class RunDirError(ValueError):
    """A run directory file that cannot be used as it is (a damaged manifest, a selection made for
    another teacher): the message says what to delete or rerun."""


class RunManifest:
    """Stage bookkeeping in <run_dir>/manifest.json."""

    def __init__(self, root: Path):
        self.path = root / MANIFEST
        self.data: dict[str, Any] = {"stages": {}}
        if self.path.is_file():
            try:
                self.data = json.loads(self.path.read_text())
            except json.JSONDecodeError as err:
                raise RunDirError(f"{self.path} is not valid JSON ({err}); delete it to rerun every stage") from None
            if not isinstance(self.data, dict) or not isinstance(self.data.setdefault("stages", {}), dict) \
                    or not all(isinstance(entry, dict) for entry in self.data["stages"].values()):
                raise RunDirError(f"{self.path} is not a megatron_tc run manifest (a JSON object whose 'stages' maps "
                                  "each stage to an object); delete it to rerun every stage")

    def entry(self, stage: str) -> dict[str, Any]:
        return self.data["stages"].get(stage, {})

    def is_complete(self, stage: str, fingerprint: str, outputs: list[Path]) -> bool:
        entry = self.entry(stage)
        return (entry.get("status") == "complete" and entry.get("fingerprint") == fingerprint
                and all(p.exists() for p in outputs))

    def mark(self, stage: str, status: str, fingerprint: str, outputs: list[Path] = (), **extra: Any) -> None:
        entry = {"status": status, "fingerprint": fingerprint, "outputs": [str(p) for p in outputs],
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}
        self.data["stages"][stage] = entry
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def run_info() -> dict[str, Any]:
    """Versions and host facts recorded in the manifest."""
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info
