"""The default init of a converted layer that strategies start from (`default_gdn_state`): the
values of the GDN-only parameters a closed form keeps at their default (docs/method.md section 4),
each drawn when first read, from a generator of its own."""
from __future__ import annotations

import hashlib
import math
from typing import Mapping

import torch
from torch import nn

from megatron_tc.model.config import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet, default_a_log, default_dt_bias
from megatron_tc.model.norm import RMSNorm


def default_gdn_state(arch: ArchConfig, index: int, seed: int = 0, init_std: float = 0.02) -> "DefaultGDNState":
    """The default state dict of GDN layer `index` of a student of `arch` (see DefaultGDNState)."""
    return DefaultGDNState(arch, index, seed, init_std)


def parameter_seed(seed: int, index: int, name: str) -> int:
    """The seed of the generator that draws parameter `name` of layer `index`'s default init: 63
    bits of SHA-256 of the three, so no value depends on which other values (or layers) are drawn."""
    digest = hashlib.sha256(f"{seed}/{index}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


_LAYOUTS: dict[str, tuple[dict[str, nn.Module], dict[str, torch.Tensor]]] = {}


def _layout(arch: ArchConfig) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """A GDN layer's submodules by name and its state dict, on `meta` (the structure only: no
    allocation, no draws), made once per architecture (every layer has the same) and dtype."""
    key = f"{arch!r}/{torch.get_default_dtype()}"
    if key not in _LAYOUTS:
        with torch.device("meta"):
            mixer = GatedDeltaNet(arch, 0, init=False)
        _LAYOUTS[key] = dict(mixer.named_modules()), mixer.state_dict()
    return _LAYOUTS[key]


class DefaultGDNState(Mapping[str, torch.Tensor]):
    """A GDN mixer's default state dict, keys, shapes and dtypes as `GatedDeltaNet(arch, index)`'s,
    each value drawn on the CPU when first read from `torch.Generator().manual_seed(parameter_seed(
    seed, index, key))`:

        Linear weights          N(0, init_std)              (HybridLM.reset_parameters' rule)
        Linear biases           zeros
        short convolutions      PyTorch's Conv1d init: U(+-1/sqrt(fan_in)), weight and bias
        A_log, dt_bias          fla's defaults (gdn.default_a_log, gdn.default_dt_bias)
        o_norm.weight           ones (RMSNorm's init)

    Every strategy replaces q/k/v/o with the teacher's, so their values are never drawn; each value
    costs only its own draw (no generator moved past other parameters' draws), on any thread."""

    def __init__(self, arch: ArchConfig, index: int, seed: int = 0, init_std: float = 0.02) -> None:
        self._modules, self._meta = _layout(arch)
        self._index, self._seed, self._std = index, seed, init_std
        self._values: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._values:
            meta = self._meta[key]  # KeyError for a name the layer does not have
            value = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
            with torch.no_grad():
                self._values[key] = self._draw(key, value)
        return self._values[key]

    def _generator(self, key: str) -> torch.Generator:
        return torch.Generator().manual_seed(parameter_seed(self._seed, self._index, key))

    def _draw(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """value filled by `key`'s rule; a generator made only for a random one (zeros and ones need none)."""
        owner, _, name = key.rpartition(".")
        module = self._modules[owner]
        if key == "A_log":
            return default_a_log(value, self._generator(key))
        if key == "dt_bias":
            return default_dt_bias(value, self._generator(key))
        if isinstance(module, nn.Linear):
            return value.normal_(0.0, self._std, generator=self._generator(key)) if name == "weight" else value.zero_()
        if isinstance(module, nn.Conv1d):  # PyTorch's init of weight and bias: U(+-1/sqrt(fan_in))
            bound = 1 / math.sqrt(module.weight[0].numel())  # fan_in: in-channels per group x kernel size
            return value.uniform_(-bound, bound, generator=self._generator(key))
        if isinstance(module, RMSNorm):
            return value.fill_(0.0 if module.unit_offset else 1.0)  # RMSNorm.reset_parameters' rule
        raise KeyError(f"no default init rule for GDN parameter {key!r} ({type(module).__name__})")

    @property
    def drawn(self) -> tuple[str, ...]:
        """The keys whose values have been read (drawn) so far, in the order they were."""
        return tuple(self._values)

    @property
    def layout(self) -> Mapping[str, torch.Tensor]:
        """The state dict's `meta` tensors (shapes and dtypes, nothing drawn); read only."""
        return self._meta

    def __iter__(self):
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)
