"""The megatron_tc checkpoint: a directory of Megatron-style TP x PP shards.

Layout of `<dir>`::

    config.json                       format, ArchConfig, tp/pp and stage spans, vocab padding,
                                      dtype, source (family, path, sha256, HF config), tokenizer files
    model_tp{t:02d}_pp{p:02d}.safetensors   one per (tp rank, pp stage); names in `layout.py`
    tokenizer/...                     the source's tokenizer files, when it had any
    manifest.json                     every file's sha256 and size, every tensor's shape and dtype

Writes are atomic (`<dir>.tmp-<pid>`, then a rename). Reads verify the sha256 of every file they
use before deserializing anything, so a corrupted or truncated file is named and nothing is
partially loaded. `checkpoint_hash(dir)` (the manifest's sha256) identifies the weights, e.g. for
statistics files that must not be applied to another teacher.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from megatron_tc.convert import layout
from megatron_tc.convert.errors import CheckpointError, ConversionError
from megatron_tc.convert.fsutil import atomic_output_dir, check_output_dir, sha256_file
from megatron_tc.convert.lazy import LazyTensor, Leaf, MemorySource, SafetensorsFile, materialize_state, sources_of
from megatron_tc.convert.lazy_layout import Lazies, resize_vocab_lazy, shard_lazy, unshard_lazy
from megatron_tc.convert.safetensors_stream import target_dtype, write_safetensors
from megatron_tc.model.config import ArchConfig, pad_vocab
from megatron_tc.monitor import progress as bar

FORMAT, FORMAT_VERSION = "megatron_tc", 1
CONFIG, MANIFEST, TOKENIZER_DIR = "config.json", "manifest.json", "tokenizer"
VOCAB_MULTIPLE = 128
StateDict = dict[str, torch.Tensor]
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def shard_filename(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors"


@dataclass
class CheckpointInfo:
    """What config.json says about a checkpoint."""

    path: Path
    arch: ArchConfig  # padded_vocab_size is the checkpoint's padding (multiple of 128 * tp)
    tp: int
    pp: int
    stages: list[tuple[int, int]]  # global [start, end) layers of each pp stage
    dtype: str
    source: dict[str, Any] = field(default_factory=dict)  # family, format, path, sha256, hf_config
    tokenizer_files: list[str] = field(default_factory=list)  # relative to <dir>/tokenizer

    @property
    def is_teacher_shaped(self) -> bool:
        return set(self.arch.layer_kinds) == {"A"}

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.path / TOKENIZER_DIR if self.tokenizer_files else None


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not supported; use auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


# ---- writing ------------------------------------------------------------------------------------
def save_checkpoint(state: StateDict | Lazies, arch: ArchConfig, out: str | os.PathLike, tp: int = 1, pp: int = 1, *,
                    dtype: str | torch.dtype | None = None, source: dict[str, Any] | None = None,
                    tokenizer_files: dict[str, bytes] | None = None, overwrite: bool = False,
                    progress: bool = False) -> Path:
    """Write an unsharded HybridLM `state` as a (tp, pp) checkpoint at `out`; returns `out`.

    `state` holds tensors or lazy tensors (`lazy.py`); either way the shards are written one
    tensor at a time, so lazy sources (a checkpoint being resharded, HF safetensors files) are
    never loaded whole. The vocabulary is padded with zero rows to a multiple of 128 * tp (rows
    past `arch.vocab_size` in `state` are dropped: they never produce logits). `dtype` casts
    floating tensors (None / "auto": keep). Every check runs before anything is written."""
    check_output_dir(out, overwrite)
    layout.check_tp(arch, tp)
    stages = layout.stage_ranges(arch, pp)
    cast = resolve_dtype(dtype)
    lazies = {k: v if isinstance(v, LazyTensor) else Leaf(MemorySource({k: v}), k, list(v.shape), v.dtype)
              for k, v in state.items()}
    padded = pad_vocab(arch.vocab_size, tp, VOCAB_MULTIPLE)
    lazies = resize_vocab_lazy(lazies, arch.vocab_size, padded)
    arch = dataclasses.replace(arch, padded_vocab_size=padded)
    shards = shard_lazy(lazies, arch, tp, pp)
    dtypes = sorted({_dtype_name(target_dtype(v, cast)) for v in lazies.values()})
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "arch": arch.to_dict(),
        "parallel": {"tp": tp, "pp": pp, "stages": [list(s) for s in stages], "layer_index": "local to the stage"},
        "vocab": {"vocab_size": arch.vocab_size, "padded_vocab_size": arch.padded_vocab_size,
                  "rule": f"multiple of {VOCAB_MULTIPLE} x tp"},
        "dtype": dtypes[0] if len(dtypes) == 1 else "mixed",
        "source": source or {},
        "tokenizer_files": sorted(tokenizer_files or {}),
    }
    with atomic_output_dir(out, overwrite) as tmp:
        files: dict[str, dict[str, Any]] = {}
        items = sorted(shards.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        total = sum(v.nbytes(target_dtype(v, cast)) for _, tensors in items for v in tensors.values())
        with bar(total=total, desc="writing checkpoint", unit="B", unit_scale=True, unit_divisor=1024,
                 enabled=progress) as written:  # bytes, not shards: one shard of a large teacher takes minutes
            for (t, p), tensors in items:
                name = shard_filename(t, p)
                written.set_postfix_str(name, refresh=False)
                digest = write_safetensors(tmp / name, tensors, cast, metadata={"format": "pt"}, written=written.update)
                files[name] = {"sha256": digest, "size": (tmp / name).stat().st_size,
                               "tensors": {k: {"shape": list(v.shape), "dtype": _dtype_name(target_dtype(v, cast))}
                                           for k, v in sorted(tensors.items())}}
        for rel, data in (tokenizer_files or {}).items():
            target = tmp / TOKENIZER_DIR / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            files[f"{TOKENIZER_DIR}/{rel}"] = _file_entry(target)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        files[CONFIG] = _file_entry(tmp / CONFIG)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return Path(out)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _file_entry(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


# ---- reading ------------------------------------------------------------------------------------
def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a megatron_tc checkpoint directory")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: {path} is not a complete megatron_tc checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupted ({err})") from err
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    return files


def _verify_files(path: Path, files: dict[str, Any], names: list[str]) -> None:
    """Check existence, size and sha256 of `names` (all before anything is deserialized)."""
    for name in names:
        if name not in files:
            raise CheckpointError(f"{path / name} is not listed in {path / MANIFEST}")
        file = path / name
        expected = files[name]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"{file} has {size} bytes, {MANIFEST} says {expected['size']}: the file is truncated or "
                "was replaced; re-create the checkpoint"
            )
        digest = sha256_file(file)
        if digest != expected["sha256"]:
            raise CheckpointError(f"{file} is corrupted: sha256 {digest} does not match {expected['sha256']} in {MANIFEST}")


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """Verify and parse config.json (only; shards are checked when they are loaded)."""
    path = Path(path)
    files = _read_manifest(path)
    _verify_files(path, files, [CONFIG])
    config = json.loads((path / CONFIG).read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / CONFIG}: format_version {config.get('format_version')} is not {FORMAT_VERSION}")
    par = config["parallel"]
    return CheckpointInfo(
        path=path, arch=ArchConfig.from_dict(config["arch"]), tp=par["tp"], pp=par["pp"],
        stages=[tuple(s) for s in par["stages"]], dtype=config["dtype"], source=config.get("source", {}),
        tokenizer_files=config.get("tokenizer_files", []),
    )


def is_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / MANIFEST).is_file() and (path / CONFIG).is_file()


def checkpoint_hash(path: str | os.PathLike) -> str:
    """sha256 of manifest.json: it covers every file's sha256, so it identifies the weights."""
    _read_manifest(Path(path))
    return sha256_file(Path(path) / MANIFEST)


def _load_verified(path: Path, files: dict[str, Any], name: str) -> StateDict:
    tensors = load_file(str(path / name))
    listed = files[name].get("tensors", {})
    found = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()}
    if found != listed:
        raise CheckpointError(f"{path / name}: tensors do not match {MANIFEST} (names, shapes or dtypes differ)")
    return tensors


def load_shard(path: str | os.PathLike, tp_rank: int, pp_rank: int) -> StateDict:
    """One rank's tensors, Megatron names (layer indices local to the stage; see `layout.py`)."""
    info = read_info(path)
    if not (0 <= tp_rank < info.tp and 0 <= pp_rank < info.pp):
        raise CheckpointError(f"rank (tp={tp_rank}, pp={pp_rank}) is outside the checkpoint's tp={info.tp}, pp={info.pp}")
    files = _read_manifest(info.path)
    name = shard_filename(tp_rank, pp_rank)
    _verify_files(info.path, files, [name])
    return _load_verified(info.path, files, name)


def load_shards(path: str | os.PathLike) -> tuple[CheckpointInfo, dict[tuple[int, int], StateDict]]:
    """Every rank's tensors; all files are verified before the first is deserialized."""
    info = read_info(path)
    files = _read_manifest(info.path)
    names = {(t, p): shard_filename(t, p) for t in range(info.tp) for p in range(info.pp)}
    _verify_files(info.path, files, sorted(names.values()) + [f"{TOKENIZER_DIR}/{f}" for f in info.tokenizer_files])
    return info, {rank: _load_verified(info.path, files, name) for rank, name in names.items()}


def _manifest_leaves(path: Path, files: dict[str, Any], name: str) -> Lazies:
    """Lazy tensors of shard `name` from the manifest's shapes and dtypes (nothing is read)."""
    source = SafetensorsFile(path / name)
    return {k: Leaf(source, k, v["shape"], getattr(torch, v["dtype"])) for k, v in files[name].get("tensors", {}).items()}


def _check_header(path: Path, files: dict[str, Any], name: str) -> None:
    """The shard's safetensors header lists exactly the manifest's tensors (after its sha256 matched)."""
    found = {k: {"shape": shape, "dtype": _dtype_name(dtype)} for k, (shape, dtype) in SafetensorsFile(path / name).header().items()}
    if found != files[name].get("tensors", {}):
        raise CheckpointError(f"{path / name}: tensors do not match {MANIFEST} (names, shapes or dtypes differ)")


def lazy_checkpoint(path: str | os.PathLike) -> tuple[CheckpointInfo, Lazies]:
    """(info, unsharded HybridLM lazy tensors) of a checkpoint; every file is verified first."""
    info = read_info(path)
    files = _read_manifest(info.path)
    names = {(t, p): shard_filename(t, p) for t in range(info.tp) for p in range(info.pp)}
    _verify_files(info.path, files, sorted(names.values()) + [f"{TOKENIZER_DIR}/{f}" for f in info.tokenizer_files])
    for name in names.values():
        _check_header(info.path, files, name)
    shards = {rank: _manifest_leaves(info.path, files, name) for rank, name in names.items()}
    return info, unshard_lazy(shards, info.arch, info.tp, info.pp)


def load_checkpoint(path: str | os.PathLike) -> tuple[ArchConfig, StateDict]:
    """(arch, unsharded HybridLM state dict); the vocabulary keeps the checkpoint's padding."""
    info, lazies = lazy_checkpoint(path)
    return info.arch, materialize_state(lazies)


def load_rank(path: str | os.PathLike, tp: int, pp: int, tp_rank: int, pp_rank: int,
              dtype: torch.dtype | None = None) -> StateDict:
    """Megatron-named tensors of rank (tp_rank, pp_rank) in a (tp, pp) layout, read from a
    checkpoint of any layout: only the slices this rank holds are read, and only the files they
    come from are verified. Equal to `load_shard` of the checkpoint resharded to (tp, pp).
    `dtype`: floating tensors are read straight into it (None: the stored dtype)."""
    info = read_info(path)
    layout.check_tp(info.arch, tp)
    layout.stage_ranges(info.arch, pp)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise CheckpointError(f"rank (tp={tp_rank}, pp={pp_rank}) is outside tp={tp}, pp={pp}")
    padded = pad_vocab(info.arch.vocab_size, tp, VOCAB_MULTIPLE)
    lazies = _unsharded_lazies(info, padded)
    mine = shard_lazy(lazies, dataclasses.replace(info.arch, padded_vocab_size=padded), tp, pp)[tp_rank, pp_rank]
    return _read_verified(info, mine, dtype)


def load_slices(path: str | os.PathLike, pick: Callable[[str, LazyTensor], LazyTensor], padded_vocab_size: int,
                dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> StateDict:
    """HybridLM-named tensors, each `pick(name, whole)` of the checkpoint's unsharded tensor (its
    vocabulary padded to `padded_vocab_size` rows), e.g. one tensor-parallel rank's rows or
    columns. Only the picked slices are read, straight into `dtype` (floating tensors; None: the
    stored dtype), and only the files they come from are verified. `device`: each tensor moves
    there as soon as it is read, so the host holds one at a time."""
    info = read_info(path)
    lazies = _unsharded_lazies(info, padded_vocab_size)
    return _read_verified(info, {name: pick(name, lazy) for name, lazy in lazies.items()}, dtype, device)


def _unsharded_lazies(info: CheckpointInfo, padded_vocab_size: int) -> Lazies:
    files = _read_manifest(info.path)
    names = {(t, p): shard_filename(t, p) for t in range(info.tp) for p in range(info.pp)}
    missing = [n for n in names.values() if n not in files]
    if missing:
        raise CheckpointError(f"{info.path / missing[0]} is not listed in {info.path / MANIFEST}")
    shards = {rank: _manifest_leaves(info.path, files, name) for rank, name in names.items()}
    return resize_vocab_lazy(unshard_lazy(shards, info.arch, info.tp, info.pp), info.arch.vocab_size, padded_vocab_size)


def _read_verified(info: CheckpointInfo, lazies: Lazies, dtype: torch.dtype | None,
                   device: torch.device | str | None = None) -> StateDict:
    """Verify the files `lazies` read from (sha256, header), then read them (onto `device`)."""
    files = _read_manifest(info.path)
    needed = sorted({s.path.name for lazy in lazies.values() for s in sources_of(lazy) if isinstance(s, SafetensorsFile)})
    _verify_files(info.path, files, needed)
    for name in needed:
        _check_header(info.path, files, name)
    out = {}
    for name, lazy in lazies.items():
        tensor = lazy.materialize(dtype if dtype is not None and lazy.dtype.is_floating_point else None)
        out[name] = tensor if device is None else tensor.to(device)
    return out


def load_shard_hybrid(path: str | os.PathLike, tp_rank: int, pp_rank: int) -> StateDict:
    """One rank's tensors under HybridLM names with global layer indices, each holding only the
    rank's part: q/k/v rows of its query groups (attention) or heads (GDN), gate/up rows,
    o_proj/down_proj columns, its vocabulary rows; replicated tensors whole. A tied model's
    last stage gets `lm_head.weight` (the copy Megatron keeps there) when pp > 1."""
    info = read_info(path)
    shard = load_shard(path, tp_rank, pp_rank)
    arch, tp = info.arch, info.tp
    local = dataclasses.replace(arch, num_heads=arch.num_heads // tp, num_kv_heads=arch.num_kv_heads // tp)
    return layout.rank_to_hybrid(shard, local, info.stages[pp_rank][0])


# ---- resharding ---------------------------------------------------------------------------------
def reshard(src: str | os.PathLike, dst: str | os.PathLike, tp: int, pp: int, *, overwrite: bool = False,
            progress: bool = False) -> Path:
    """Rewrite checkpoint `src` with another (tp, pp) at `dst`, shard to shard (no HF detour),
    one tensor at a time: each output tensor reads only the source slices it is made of.

    The vocabulary padding follows the new tp; source info and tokenizer files are kept."""
    check_output_dir(dst, overwrite)
    info = read_info(src)
    layout.check_tp(info.arch, tp)
    layout.stage_ranges(info.arch, pp)
    info, lazies = lazy_checkpoint(src)
    tokenizer = {rel: (info.path / TOKENIZER_DIR / rel).read_bytes() for rel in info.tokenizer_files}
    source = dict(info.source, resharded_from={"tp": info.tp, "pp": info.pp, "manifest_sha256": checkpoint_hash(src)})
    return save_checkpoint(lazies, info.arch, dst, tp, pp, source=source, tokenizer_files=tokenizer,
                           overwrite=overwrite, progress=progress)
