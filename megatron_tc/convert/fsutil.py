"""Atomic output directories and file hashes, shared by checkpoint writing and HF export."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from megatron_tc.convert.errors import ConversionError

_CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One hash over several files (in the given order), e.g. the weight files of an HF model."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while block := handle.read(_CHUNK):
                digest.update(block)
    return digest.hexdigest()


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing output unless `overwrite`; call it before any expensive work."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConversionError(f"output {out} already exists; pass overwrite=True (--overwrite on the command line) to replace it")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output {out} exists and is not a directory")
    return out


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory `<out>.tmp-<pid>`; on success it replaces `out` by renames.

    On any exception the temporary directory is removed and `out` is left as it was."""
    out = check_output_dir(out, overwrite).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _finalize_files(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _finalize_files(directory: Path) -> None:
    """fsync every file, and give it the usual umask mode (safetensors writes 0600, which would
    hide a shared checkpoint from the rest of a cluster group)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o666 & ~mask)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
