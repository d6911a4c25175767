"""`TaylorStats`: the statistics pass's result — fp64 sums with metadata, reduced, saved, checked.

Sums are stored flat as ``layers.{l}.{key}`` (attention sums, docs/method.md section 3) and
``readout.{strategy}.layers.{l}.{key}`` (readout sums). Because everything is a sum, one
all-reduce(SUM) over data-parallel ranks followed by a division gives exactly the statistics of
the union of the ranks' data. A file records the teacher's weight hash and the layers it covers
and refuses to be applied to another teacher or to layers it did not measure.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_tc.parallel.comm import all_reduce_

from .moments import DENOMINATOR

FORMAT_VERSION = 1


class StatsMismatchError(ValueError):
    """A stats file applied to a teacher or a layer pattern it was not computed for."""


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, shape, fp32 bytes) of every tensor in name order: a hash of the
    weights that does not depend on the file format, dtype of storage or sharding."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{list(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


@dataclass
class TaylorStats:
    meta: dict[str, Any]
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    # `_group`'s index of the sums' names by layer prefix, and the keys it was made from
    _index: dict[str, list[tuple[str, str]]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _index_keys: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    # ---- access ------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Attention sums of one layer, key -> fp64 tensor."""
        out = self._group(f"layers.{index}.")
        if not out:
            raise StatsMismatchError(f"the stats cover layers {self.layers}, not layer {index}")
        return out

    def _group(self, prefix: str) -> dict[str, torch.Tensor]:
        """The sums under `prefix` (up to a layer's: "layers.{l}." or "readout.{s}.layers.{l}."),
        named without it. The names are grouped once per set of keys (closed forms read a layer's
        sums many times, and a file holds hundreds of them); the tensors are read from `sums`."""
        keys = tuple(self.sums)
        if self._index_keys != keys:
            self._index = {}
            for key in keys:
                cut = key.index(".layers.") + len(".layers.") if key.startswith("readout.") else len("layers.")
                cut = key.find(".", cut) + 1
                self._index.setdefault(key[:cut], []).append((key[cut:], key))
            self._index_keys = keys
        return {name: self.sums[key] for name, key in self._index.get(prefix, ())}

    def readout(self, strategy: str, index: int) -> dict[str, torch.Tensor]:
        out = self._group(f"readout.{strategy}.layers.{index}.")
        if not out:
            have = sorted(self.meta.get("readout", {}))
            raise StatsMismatchError(
                f"the stats hold no readout sums of strategy {strategy!r} for layer {index} "
                f"(readout sums present for: {have or 'none'}); rerun the statistics pass with "
                f"this strategy in `readout_strategies`"
            )
        return out

    def check_readout_products(self, name: str, strategy: str, reader: str | None = None) -> None:
        """Raise StatsMismatchError unless the readout sums of `name` hold the sums after o_proj
        (G, r, YY) that `reader` (default: `strategy`, whose statistics pass would make them) reads.
        Sweep 2 makes them only for the closed forms whose strategy reads them; a file that does not
        say (written before that choice) has them."""
        if self.meta.get("readout", {}).get(name, {}).get("products", True):
            return
        raise StatsMismatchError(
            f"the readout sums of {name!r} in these stats lack the sums after o_proj (G, r, YY) that "
            f"{reader or strategy} reads (they were made for a strategy that does not read them); rerun the "
            f"statistics pass with {strategy} in `readout_strategies` (tools/stats.py --readout {strategy}; "
            f"in the pipeline, calibrate.init={strategy})"
        )

    def mean(self, index: int, key: str) -> torch.Tensor:
        """Per-head mean of an attention statistic (sum / its token count)."""
        sums = self.layer(index)
        return sums[key] / sums[DENOMINATOR[key]].clamp_min(1.0)

    # ---- checks ------------------------------------------------------------------------------
    def check_applies_to(self, teacher_sha256: str | None, converted_layers: list[int]) -> None:
        """Raise StatsMismatchError unless these stats were measured on this teacher and cover
        every layer that will be converted."""
        mine = self.meta.get("teacher_sha256")
        if teacher_sha256 is not None and mine != teacher_sha256:
            raise StatsMismatchError(
                f"stats were computed for teacher {mine[:12] if mine else None}… but the teacher "
                f"given has weights hash {teacher_sha256[:12]}…; recompute them with "
                "`python tools/stats.py --teacher <this teacher>`"
            )
        missing = sorted(set(converted_layers) - set(self.layers))
        if missing:
            raise StatsMismatchError(
                f"layers {missing} are converted to GDN but the stats cover only layers "
                f"{self.layers} (pattern {self.meta.get('layer_pattern')!r}); recompute them "
                "with those layers included"
            )

    # ---- distributed -------------------------------------------------------------------------
    def all_reduce_(self, group: dist.ProcessGroup | None = None) -> "TaylorStats":
        """Sum every tensor over `group` with ONE all-reduce of a flat fp64 buffer."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self
        keys = sorted(self.sums)
        flat = torch.cat([self.sums[k].reshape(-1) for k in keys])
        all_reduce_(flat, dist.ReduceOp.SUM, group)  # on the communication device (NCCL: the GPU)
        offset = 0
        for k in keys:
            n = self.sums[k].numel()
            self.sums[k] = flat[offset: offset + n].view_as(self.sums[k]).clone()
            offset += n
        key = f"layers.{self.layers[0]}.count" if self.layers else None
        if key in self.sums:
            self.meta["tokens"] = int(self.sums[key].item())
        return self

    # ---- io ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Atomic write (temp file in the same directory, then rename)."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".stats.", dir=directory)
        os.close(fd)
        try:
            torch.save({"format_version": FORMAT_VERSION, "meta": self.meta, "sums": self.sums}, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(
        cls, path: str | os.PathLike, teacher_sha256: str | None = None, converted_layers: list[int] | None = None
    ) -> "TaylorStats":
        """Load a stats file; with `teacher_sha256` / `converted_layers` refuse a mismatch."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"stats file {path} does not exist; create it with tools/stats.py")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated, empty or not a torch file: torch does not name it
            raise StatsMismatchError(f"stats file {path} cannot be read ({type(err).__name__}: {err}); it is "
                                     "truncated or corrupted: recompute it with tools/stats.py") from err
        if not isinstance(blob, dict) or blob.get("format_version") != FORMAT_VERSION:
            raise StatsMismatchError(f"{path} is not a megatron_tc stats file (format {FORMAT_VERSION})")
        stats = cls(meta=blob["meta"], sums=blob["sums"])
        stats.check_applies_to(teacher_sha256, converted_layers or [])
        return stats
