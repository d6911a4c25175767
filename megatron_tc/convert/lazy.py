"""Lazy tensors: a recipe for a tensor (slices of stored tensors, zero rows, concatenations) that
is read only when it is written out, so converting or resharding a checkpoint holds one tensor at
a time instead of the whole model.

A `Leaf` is a box (a start:stop range per dimension) of one tensor in a source: a
safetensors file (read with `safe_open(...).get_slice`, which reads only the box's bytes) or
tensors already in memory (GGUF, pytorch .bin, a trained model). `Cat` joins lazies along one
dimension, `Zeros` is vocabulary padding, `Replicated` is a tensor every TP rank holds a copy of
(the copies are compared when read). `narrow` never reads anything; `materialize` allocates the
result once and fills it piece by piece, so the peak is the result plus its largest piece.

`ReadStats` (opt-in through `track_reads`) records the largest single read and the largest
materialized tensor: a deterministic measure of the memory a conversion needs.
"""
from __future__ import annotations

import abc
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open

from megatron_tc.convert.errors import ConversionError

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


@dataclass
class ReadStats:
    """Bytes of the largest single read and of the largest tensor materialized; bytes read in all."""

    max_read_bytes: int = 0
    max_materialized_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0


_STATS: list[ReadStats] = []


@contextlib.contextmanager
def track_reads() -> Iterator[ReadStats]:
    stats = ReadStats()
    _STATS.append(stats)
    try:
        yield stats
    finally:
        _STATS.remove(stats)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


# ---- sources ------------------------------------------------------------------------------------
class SafetensorsFile:
    """One safetensors file. Every read opens the file anew: a handle kept open would keep every
    page it ever touched mapped, and the resident size would grow to the file's size."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def header(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """{name: (shape, dtype)} from the file's header (no tensor data is read)."""
        out = {}
        with safe_open(str(self.path), "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                code = piece.get_dtype()
                if code not in SAFETENSORS_DTYPES:
                    raise ConversionError(f"{self.path}: tensor {name} has dtype {code}, which is not supported")
                out[name] = (list(piece.get_shape()), SAFETENSORS_DTYPES[code])
        return out

    def leaves(self) -> dict[str, "Leaf"]:
        return {name: Leaf(self, name, shape, dtype) for name, (shape, dtype) in self.header().items()}

    def read(self, name: str, box: Box) -> torch.Tensor:
        with safe_open(str(self.path), "pt") as handle:
            return handle.get_slice(name)[tuple(slice(a, b) for a, b in box)]

    def __repr__(self) -> str:
        return str(self.path)


class MemorySource:
    """Tensors already in memory (a state dict)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def leaves(self) -> dict[str, "Leaf"]:
        return {name: Leaf(self, name, list(t.shape), t.dtype) for name, t in self.tensors.items()}

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.tensors[name][tuple(slice(a, b) for a, b in box)]


def lazy_state(tensors: dict[str, torch.Tensor]) -> dict[str, "LazyTensor"]:
    return MemorySource(tensors).leaves()


# ---- lazy tensors -------------------------------------------------------------------------------
class LazyTensor(abc.ABC):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @abc.abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        """The slice [start, start + length) of dimension `dim`, still unread."""

    @abc.abstractmethod
    def fill(self, out: torch.Tensor) -> None:
        """Write the values into `out` (same shape; any dtype: values are cast as `Tensor.to` does)."""

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return _nbytes(self.shape, dtype or self.dtype)

    def materialize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype or self.dtype)
        self.fill(out)
        for stats in _STATS:
            stats.max_materialized_bytes = max(stats.max_materialized_bytes, out.numel() * out.element_size())
        return out

    def __getitem__(self, rows: slice) -> "LazyTensor":
        """Only `x[a:b]` (rows), as the HF name mapping uses it."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("lazy tensors take contiguous row slices only")
        return self.narrow(0, start, max(stop - start, 0))

    def _check_narrow(self, dim: int, start: int, length: int) -> None:
        if not (0 <= dim < len(self.shape) and 0 <= start and start + length <= self.shape[dim]):
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside shape {list(self.shape)}")


class Leaf(LazyTensor):
    def __init__(self, source: SafetensorsFile | MemorySource, name: str, shape: Sequence[int],
                 dtype: torch.dtype, box: Box | None = None):
        self.source, self.name, self.dtype = source, name, dtype
        self.box = box if box is not None else tuple((0, s) for s in shape)
        self.shape = tuple(b - a for a, b in self.box)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        self._check_narrow(dim, start, length)
        a = self.box[dim][0] + start
        box = self.box[:dim] + ((a, a + length),) + self.box[dim + 1:]
        return Leaf(self.source, self.name, (), self.dtype, box)

    def fill(self, out: torch.Tensor) -> None:
        part = self.source.read(self.name, self.box)
        for stats in _STATS:
            stats.reads += 1
            stats.read_bytes += part.numel() * part.element_size()
            stats.max_read_bytes = max(stats.max_read_bytes, part.numel() * part.element_size())
        out.copy_(part.reshape(self.shape))

    def __repr__(self) -> str:
        return f"Leaf({self.source!r}:{self.name}{list(self.box)})"


class Zeros(LazyTensor):
    def __init__(self, shape: Sequence[int], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        self._check_narrow(dim, start, length)
        return Zeros(self.shape[:dim] + (length,) + self.shape[dim + 1:], self.dtype)

    def fill(self, out: torch.Tensor) -> None:
        out.zero_()


class Cat(LazyTensor):
    """`torch.cat(parts, dim)` without reading the parts."""

    def __init__(self, parts: Sequence[LazyTensor], dim: int):
        parts = [p for p in parts if p.shape[dim] > 0] or list(parts[:1])
        if not parts:
            raise ValueError("Cat of no tensors")
        rest = {p.shape[:dim] + p.shape[dim + 1:] for p in parts}
        if len(rest) != 1 or len({p.dtype for p in parts}) != 1:
            raise ConversionError(f"cannot concatenate {[list(p.shape) for p in parts]} along dim {dim} "
                                  f"(dtypes {sorted({str(p.dtype) for p in parts})})")
        self.parts, self.dim, self.dtype = list(parts), dim, parts[0].dtype
        first = parts[0].shape
        self.shape = first[:dim] + (sum(p.shape[dim] for p in parts),) + first[dim + 1:]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        self._check_narrow(dim, start, length)
        if dim != self.dim:
            return Cat([p.narrow(dim, start, length) for p in self.parts], self.dim)
        picked, offset = [], 0
        for part in self.parts:
            size = part.shape[dim]
            lo, hi = max(start, offset), min(start + length, offset + size)
            if lo < hi:
                picked.append(part.narrow(dim, lo - offset, hi - lo))
            offset += size
        return picked[0] if len(picked) == 1 else Cat(picked, dim)

    def fill(self, out: torch.Tensor) -> None:
        offset = 0
        for part in self.parts:
            size = part.shape[self.dim]
            part.fill(out.narrow(self.dim, offset, size))
            offset += size


class Replicated(LazyTensor):
    """A tensor stored once per TP rank; reading it checks that the copies are equal."""

    def __init__(self, copies: Sequence[LazyTensor], name: str):
        shapes = {c.shape for c in copies}
        if len(shapes) != 1:
            raise ConversionError(f"replicated tensor {name} has shapes {sorted(shapes)} on different tp ranks")
        self.copies, self.name, self.shape, self.dtype = list(copies), name, copies[0].shape, copies[0].dtype

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return Replicated([c.narrow(dim, start, length) for c in self.copies], self.name)

    def fill(self, out: torch.Tensor) -> None:
        first = self.copies[0].materialize()
        for rank, copy in enumerate(self.copies[1:], start=1):
            if not torch.equal(copy.materialize(), first):
                raise ConversionError(f"replicated tensor {self.name} differs between tp rank 0 and tp rank {rank}")
        out.copy_(first)


def materialize_state(lazies: dict[str, LazyTensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {name: lazy.materialize(dtype) for name, lazy in lazies.items()}


def sources_of(lazy: LazyTensor) -> list[SafetensorsFile | MemorySource]:
    """Every source a lazy tensor reads from (e.g. to verify only the files a rank needs)."""
    if isinstance(lazy, Leaf):
        return [lazy.source]
    children = lazy.parts if isinstance(lazy, Cat) else lazy.copies if isinstance(lazy, Replicated) else []
    found: dict[int, SafetensorsFile | MemorySource] = {}
    for child in children:
        found.update({id(s): s for s in sources_of(child)})
    return list(found.values())
