"""CUDA-graph replays of the statistics pass's per-layer work.

Each sweep runs the same computation for every selected layer and batch: a few hundred small
kernels whose launches, not their math, decide the time on a GPU (the host queues them slower than
the device runs them). `LayerGraphs` captures such a computation once per signature (the shapes
and dtypes of its tensors, the configuration of its modules) and replays it for every other layer
and batch of that signature: the layer's weights and inputs are copied into the graph's static
copies (one multi-tensor copy), the graph replays, and the caller adds its static outputs into
its sums. Element-wise kernels and reductions run as they do eagerly; cuBLAS may pick other GEMM
algorithms under capture, so sums made by GEMMs can differ from the eager ones in rounding
(tests/gpu/test_stats_graphs_cuda.py: within 1e-4).

A signature is captured the second time it is seen (the first call runs eagerly: it compiles and
autotunes the Triton kernels, which capturing cannot do, and a shape seen once costs no capture).
Only CUDA tensors are captured, and only with $MEGATRON_TC_STATS_GRAPHS=1: the default is eager,
because the pipeline's batches carry document ids, which never replay, and the replays' sums differ
from the eager ones in rounding (docs/benchmarks.md, "Statistics pass and calibration", times both
on rows without documents). A computation that cannot be captured (a host sync inside) runs eagerly from
then on, with one warning.
"""
from __future__ import annotations

import copy
import os
import warnings
from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import nn

GRAPHS_ENV = "MEGATRON_TC_STATS_GRAPHS"  # 0 (default): eager; 1: replay on CUDA
Sums = dict[Hashable, torch.Tensor]
LayerFn = Callable[[Sequence[nn.Module], Sequence[torch.Tensor | None], Hashable], Sums]


def graphs_enabled() -> bool:
    """$MEGATRON_TC_STATS_GRAPHS: 0 (default) or 1; another value is an error."""
    mode = os.environ.get(GRAPHS_ENV, "0")
    if mode not in ("0", "1"):
        raise ValueError(f"${GRAPHS_ENV}={mode!r}: use 0 (eager, the default) or 1 (CUDA graphs)")
    return mode == "1"


def graphs_allowed(tp_group: dist.ProcessGroup | None) -> bool | None:
    """`LayerGraphs(enabled=...)` for a sweep over a teacher: None (as $MEGATRON_TC_STATS_GRAPHS
    says), but False with a tensor-parallel teacher, whose sharded layers reduce over the group
    inside."""
    return None if tp_group is None or dist.get_world_size(tp_group) == 1 else False


def _config(module: nn.Module) -> tuple:
    """The plain attributes of every submodule (what its computation may read besides tensors),
    without `layer_idx`: layers that differ only in their index share a graph."""
    out = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_") and k != "layer_idx"
                             and isinstance(v, (int, float, str, bool, type(None), tuple))))
        out.append((name, type(sub).__qualname__, attrs))
    return tuple(out)


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)


def _state(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `module`, in a fixed order (the static copy's matches), but
    `meta` placeholders (a readout mixer's output gate, which no sum reads)."""
    return [t.detach() for t in module.parameters() if not t.is_meta] + [t for t in module.buffers() if not t.is_meta]


def _static_module(module: nn.Module) -> nn.Module:
    """A copy of `module` whose tensors the graph reads; hooks dropped (only its methods are called)."""
    out = copy.deepcopy(module)
    for sub in out.modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                      "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            getattr(sub, hooks, {}).clear()
    return out


def _capturable(tensors: Sequence[torch.Tensor | None]) -> bool:
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.is_cuda for t in present)


class _Captured:
    """One signature's graph: static modules and inputs, and the outputs the replay writes."""

    def __init__(self, fn: LayerFn, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor | None],
                 spec: Hashable, pool):
        self.modules = [_static_module(m) for m in modules]
        self.inputs = [None if t is None else t.clone() for t in tensors]
        self.static = [t for m in self.modules for t in _state(m)] + [t for t in self.inputs if t is not None]
        self.record(fn, spec, pool)

    def record(self, fn: LayerFn, spec: Hashable, pool) -> None:
        """Capture on a side stream (the default stream cannot be captured). Not through
        `torch.cuda.graph`: it synchronizes and empties the device's memory cache before each
        capture, which the sweeps then refill."""
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            self.graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                self.out = fn(self.modules, self.inputs, spec)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> Sums:
        self.graph.replay()
        return self.out

    def __call__(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor | None]) -> Sums:
        live = [t for m in modules for t in _state(m)] + [t for t in tensors if t is not None]
        torch._foreach_copy_(self.static, live)
        return self.replay()


class LayerGraphs:
    """fn(modules, tensors, spec) -> {name: tensor}, replayed from a CUDA graph per signature.

    fn must be a pure function of its modules' tensors and configuration, of `tensors` (shapes
    decide its host-side branches, never values) and of `spec` (any other hashable structure it
    reads), and must not wait for the device. The returned tensors are the graph's static outputs:
    read (or add) them before the next call."""

    def __init__(self, fn: LayerFn, enabled: bool | None = None):
        self.fn = fn
        self.enabled = graphs_enabled() if enabled is None else enabled
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, _Captured | None] = {}  # None: capturing failed, eager
        self.pool = None
        self.modules: dict[int, tuple[nn.Module, tuple]] = {}

    def key(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor | None], spec: Hashable) -> tuple:
        return (spec, tuple(self.module_key(m) for m in modules), tuple(_tensor_key(t) for t in tensors))

    def module_key(self, module: nn.Module) -> tuple:
        """A module's configuration and tensor layout, worked out once per module of the pass
        (kept with the module, so an id is never reused while its entry lives)."""
        if id(module) not in self.modules:
            self.modules[id(module)] = (module, (_config(module), tuple(_tensor_key(t) for t in _state(module))))
        return self.modules[id(module)][1]

    def __call__(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor | None],
                 spec: Hashable = ()) -> Sums:
        if not (self.enabled and _capturable(tensors)):
            return self.eager(modules, tensors, spec)
        key = self.key(modules, tensors, spec)
        if key in self.graphs:
            captured = self.graphs[key]
            return self.eager(modules, tensors, spec) if captured is None else captured(modules, tensors)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:  # compiles and autotunes the kernels; a shape seen once is never captured
            return self.eager(modules, tensors, spec)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.graphs[key] = _Captured(self.fn, modules, tensors, spec, self.pool)
        except Exception as exc:  # a host sync or an uncapturable kernel: eager from now on
            warnings.warn(f"statistics pass: per-layer work not captured as a CUDA graph ({type(exc).__name__}: "
                          f"{exc}); it runs eagerly", RuntimeWarning, stacklevel=2)
            self.graphs[key] = None
            torch.cuda.synchronize()
            return self.eager(modules, tensors, spec)
        return self.graphs[key](modules, tensors)

    def eager(self, modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor | None],
              spec: Hashable = ()) -> Sums:
        with torch.no_grad():
            return self.fn(modules, tensors, spec)

    def close(self) -> None:
        """Drop the graphs and their memory."""
        self.graphs.clear()
        self.seen.clear()
        self.modules.clear()
        self.pool = None
