"""What a training step really holds, for checking the memory plan (`parallel.memory_plan`).

- `layer_saved_bytes`: bytes one decoder layer keeps for its backward, per token, measured on the
  model code that runs (fla kernels and compiled blocks on CUDA). On CUDA it is the allocator's
  growth across a training forward (exact for whatever autograd, fla's autograd functions and the
  compiled blocks decide to keep); on CPU the storages passed to autograd's saved-tensor hooks.
  Both count the layer's input (kept by its first norm) and not its weights.
- `PhasePeaks`: peak allocated bytes of the forward + backward and of the optimizer step of one
  training step, read from the CUDA allocator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tc.model import ArchConfig
from megatron_tc.model.transformer import DecoderLayer


def _forward(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return layer(x, positions, None, None)


def _saved_by_hooks(layer: DecoderLayer, x: torch.Tensor) -> int:
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(layer, x)
    return sum(saved.values())


def _saved_by_allocator(layer: DecoderLayer, x: torch.Tensor) -> int:
    _forward(layer, x)  # compile and autotune outside the measurement (no backward needed)
    torch.cuda.synchronize(x.device)
    before = torch.cuda.memory_allocated(x.device)
    out = _forward(layer, x)
    torch.cuda.synchronize(x.device)
    grown = torch.cuda.memory_allocated(x.device) - before
    del out  # the output [B, T, hidden] is the size of the input, which `before` already held
    return grown


def layer_saved_bytes(arch: ArchConfig, kind: str, batch: int, seq: int, device: torch.device,
                      dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per token one `kind` ('A' / 'G') layer of `arch` keeps for backward on [batch, seq]
    inputs of `dtype` (the input included, weights excluded)."""
    idx = arch.layer_kinds.index(kind)
    torch.manual_seed(0)
    with torch.device(device):
        layer = DecoderLayer(arch, idx).to(dtype)
        x = torch.randn(batch, seq, arch.hidden_size, dtype=dtype, requires_grad=True)
    measure = _saved_by_allocator if device.type == "cuda" else _saved_by_hooks
    total = measure(layer, x)
    del layer, x
    return total / (batch * seq)


@dataclass
class PhasePeaks:
    """Peak allocated bytes per phase of one step (CUDA allocator; zeros elsewhere)."""

    device: torch.device
    static: int = 0
    forward_backward: int = 0
    optimizer_step: int = 0

    def _on(self) -> bool:
        return self.device.type == "cuda"

    def start(self) -> None:
        if self._on():
            torch.cuda.synchronize(self.device)
            self.static = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def after_backward(self) -> None:
        if self._on():
            torch.cuda.synchronize(self.device)
            self.forward_backward = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def after_step(self) -> None:
        if self._on():
            torch.cuda.synchronize(self.device)
            self.optimizer_step = torch.cuda.max_memory_allocated(self.device)

    def as_gib(self) -> dict[str, float]:
        return {f"{k}_GiB": v / 2**30 for k, v in (("static", self.static), ("fwd_bwd_peak", self.forward_backward),
                                                     ("step_peak", self.optimizer_step))}
