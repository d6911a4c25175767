"""Write a safetensors file one tensor at a time, hashing the bytes as they are written.

The header is computed from shapes and dtypes before any tensor is read; then each tensor is
materialized, written and dropped. The bytes are exactly those `safetensors.torch.save` produces
for the same tensors (header ordered by dtype, then name; padded with spaces to 8 bytes), so a
streamed checkpoint has the same sha256 as one written from memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable

import torch

from megatron_tc.convert.lazy import LazyTensor

# safetensors orders tensors by its dtype enum, largest first, then by name
_DTYPE_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
                "I64", "U64"]
_CODES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}


def target_dtype(lazy: LazyTensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written with: `cast` applies to floating tensors only."""
    return cast if cast is not None and lazy.dtype.is_floating_point else lazy.dtype


def _ordered(tensors: dict[str, LazyTensor], cast: torch.dtype | None) -> list[tuple[str, LazyTensor, str]]:
    rows = [(name, lazy, _CODES[target_dtype(lazy, cast)]) for name, lazy in tensors.items()]
    return sorted(rows, key=lambda r: (-_DTYPE_ORDER.index(r[2]), r[0]))


def header_bytes(tensors: dict[str, LazyTensor], cast: torch.dtype | None = None,
                 metadata: dict[str, str] | None = None) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, lazy, code in _ordered(tensors, cast):
        size = lazy.nbytes(target_dtype(lazy, cast))
        entries[name] = {"dtype": code, "shape": list(lazy.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_safetensors(path: str | os.PathLike, tensors: dict[str, LazyTensor], cast: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None, written: Callable[[int], object] | None = None) -> str:
    """Write `tensors` to `path`, holding one tensor at a time; returns the file's sha256.
    written: called with each tensor's bytes once they are in the file (a progress bar's update)."""
    digest = hashlib.sha256()
    with open(Path(path), "wb") as handle:
        head = header_bytes(tensors, cast, metadata)
        handle.write(head)
        digest.update(head)
        for _, lazy, _ in _ordered(tensors, cast):
            tensor = lazy.materialize(target_dtype(lazy, cast)).contiguous()
            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            handle.write(data)
            digest.update(data)
            if written is not None:
                written(len(data))
            del tensor, data
    return digest.hexdigest()
