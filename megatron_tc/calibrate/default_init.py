"""The default init of a converted layer that strategies start from (`default_gdn_state`), drawing
only the values that are read (docs/method.md section 4: the GDN-only parameters a closed form keeps
at their default)."""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Mapping

import torch

from megatron_tc.model.config import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet


def default_gdn_state(arch: ArchConfig, index: int, seed: int = 0, init_std: float = 0.02,
                      draw: bool = True) -> "DefaultGDNState":
    """The model's default init of GDN layer `index` (as HybridLM.reset_parameters), drawn from a
    generator seeded by (seed, index) so it does not depend on which other layers exist. Always
    drawn on the CPU (the same numbers whatever device the teacher is on), from a generator of its
    own (never the global one: states may be made on another thread). draw=False: the draws are
    made on first use or by `DefaultGDNState.draw`. See DefaultGDNState."""
    return DefaultGDNState(arch, index, seed, init_std, draw)


class DefaultGDNState(Mapping[str, torch.Tensor]):
    """A GDN mixer's default state dict, bit for bit that of a GatedDeltaNet built on the CPU (its
    constructor's init) whose Linear weights are then redrawn from N(0, init_std), biases zeroed,
    and whose gate parameters are reset again, all from one seeded generator.

    Most of those draws are never read: the constructor's Linear draws are overwritten, and every
    strategy replaces the q/k/v/o weights with the teacher's. So the sequence only moves the
    generator past them (`_skip_draws`), keeping its state where each Linear weight's N(0, std)
    draw starts; that weight is allocated and drawn from there when it is first read (until then
    it is a `meta` tensor: an unread weight costs no memory, so every layer's state can be made
    ahead of its use). The other values (short convolutions, gate parameters, norm, zero biases)
    are drawn as the sequence draws them."""

    def __init__(self, arch: ArchConfig, index: int, seed: int = 0, init_std: float = 0.02, draw: bool = True) -> None:
        """draw=False: only the layer's structure now (Python work); the draws (`draw`, CPU work
        that mostly runs with the interpreter lock released) on first use or when asked, on any thread."""
        with torch.device("meta"):  # the structure only: no allocation, no draws
            self._mixer = GatedDeltaNet(arch, index, init=False)
        self._std, self._pending, self._seed = init_std, {}, seed * 100003 + index  # as torch.manual_seed would seed
        self._state: dict[str, torch.Tensor] | None = None
        if draw:
            self.draw()

    def draw(self) -> "DefaultGDNState":
        """Run the generator's sequence (once): the constructor's draws, in its order, then the redraws."""
        if self._state is not None:
            return self
        mixer, generator = self._mixer, torch.Generator().manual_seed(self._seed)
        # a process-wide default device (torch.set_default_device) must not move the draws off the CPU
        on_cpu = contextlib.nullcontext() if torch.get_default_device().type == "cpu" else torch.device("cpu")
        with on_cpu, torch.no_grad():
            mixer.to_empty(device="cpu", recurse=False)  # A_log, dt_bias: written below
            for child in mixer.children():  # the constructor's draws, in its order
                if isinstance(child, torch.nn.Linear):
                    for param in child.parameters():  # kaiming_uniform_ of the weight, uniform_ of the bias
                        _skip_uniform(param, generator)
                else:
                    child.to_empty(device="cpu")
                    _reset_child(child, generator)
            mixer.reset_gdn_parameters(generator)  # A_log, dt_bias (their zeros are overwritten here)
            for name, module in mixer.named_modules():
                if isinstance(module, torch.nn.Linear):
                    self._pending[f"{name}.weight"] = generator.get_state()
                    _skip_normal(module.weight, generator)
                    if module.bias is not None:
                        module.bias = torch.nn.Parameter(torch.zeros_like(module.bias, device="cpu"))
            mixer.reset_gdn_parameters(generator)
        self._state = mixer.state_dict()  # detached; the module is ours, no copies
        del self._mixer
        return self

    def __getitem__(self, key: str) -> torch.Tensor:
        self.draw()
        if key in self._pending:  # a Linear weight: its N(0, std) draw from where the sequence had it
            generator = torch.Generator()
            generator.set_state(self._pending.pop(key))
            meta = self._state[key]
            self._state[key] = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
            torch.nn.init.normal_(self._state[key], std=self._std, generator=generator)
        return self._state[key]

    def draw_read_values(self, teacher_copied: bool = True) -> "DefaultGDNState":
        """Draw now every pending Linear weight but (teacher_copied) the q/k/v/o projections every
        strategy replaces with the teacher's: the values a closed form reads, made ahead of it."""
        self.draw()
        for key in list(self._pending):
            if not (teacher_copied and key.split("_proj.")[0] in ("q", "k", "v", "o")):
                self[key]
        return self

    def __iter__(self):
        return iter(self.draw()._state)

    def __len__(self) -> int:
        return len(self.draw()._state)


def _reset_child(child: torch.nn.Module, generator: torch.Generator) -> None:
    """`child.reset_parameters()` drawing from `generator`: a Conv1d's init (kaiming_uniform_ with
    a = sqrt(5), as nn.Conv1d.reset_parameters; its bias, none here, is refused), or a module
    that draws nothing (RMSNorm)."""
    if isinstance(child, torch.nn.Conv1d):
        if child.bias is not None:
            raise NotImplementedError("a GDN short convolution with a bias has no default-init replay")
        torch.nn.init.kaiming_uniform_(child.weight, a=math.sqrt(5), generator=generator)
    else:
        child.reset_parameters()


def _skip_uniform(param: torch.Tensor, generator: torch.Generator) -> None:
    """Move `generator` (CPU) on as `uniform_` on `param` does: one 32-bit draw per fp32 element
    (checked in the tests); another dtype is drawn."""
    if param.dtype == torch.float32:
        _skip_draws(param.numel(), generator)
    else:
        torch.empty(param.shape, dtype=param.dtype, device="cpu").uniform_(generator=generator)


def _skip_normal(weight: torch.Tensor, generator: torch.Generator) -> None:
    """Move `generator` (CPU) on as `normal_` on `weight` does. A contiguous fp32 tensor whose size
    is a multiple of 16 takes one 32-bit draw per element (checked in the tests); any other is drawn."""
    if weight.dtype == torch.float32 and weight.is_contiguous() and weight.numel() % 16 == 0:
        _skip_draws(weight.numel(), generator)
    else:
        torch.empty(weight.shape, dtype=weight.dtype, device="cpu").normal_(generator=generator)


SKIP_CHUNK = 1 << 18  # 64-bit draws per call of `_skip_draws` at most (2 MB: stays in cache)
# one reused buffer per thread: a fresh 8 MB tensor per call cost as much in page faults
_SKIP_BUFFER = threading.local()


def _skip_draws(words: int, generator: torch.Generator) -> None:
    """Move `generator` (CPU) on by `words` 32-bit draws, as fp32 uniform_ draws of `words`
    elements do, without their values: one 64-bit integer takes two draws (about half the time
    of two fp32 uniform draws), written into one buffer reused by every call of the thread."""
    buffer = getattr(_SKIP_BUFFER, "buffer", None)
    if buffer is None or buffer.numel() != SKIP_CHUNK:
        buffer = _SKIP_BUFFER.buffer = torch.empty(SKIP_CHUNK, dtype=torch.int64)
    pairs = words // 2
    while pairs:
        take = min(pairs, SKIP_CHUNK)
        buffer[:take].random_(generator=generator)
        pairs -= take
    if words % 2:
        torch.empty(1).uniform_(generator=generator)
