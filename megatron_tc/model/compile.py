"""Compiling a model one decoder layer at a time (torch.compile per block, as torchtitan does).

Every `DecoderLayer` of a `HybridLM` is compiled in place (`nn.Module.compile`): its norms,
projections, rotary embedding, attention call, GDN gates, output gate, MLP and residual adds
become a few fused kernels per layer instead of dozens of small ones, which is what a small model
at a large batch is bound by. The layers of one kind share one compiled graph (torch treats the
parameters as graph inputs), so a 30-layer model compiles two graphs per input shape, not thirty.
The gated delta rule itself stays outside the graph (fla's Triton kernels, or the PyTorch chunked
path; see `model/gdn.py`), so a GDN layer is two graphs around it.

Shapes are static (`dynamic=False`): one set of kernels for the training shape, another for each
new evaluation shape; names and checkpoints are unchanged (no `_orig_mod.` prefix).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .fused import _configure_compiler


def compile_decoder_layers(model: nn.Module, backend: Any = "inductor") -> int:
    """Compile every entry of `model.layers` in place; returns how many were compiled.

    backend: torch.compile's backend ("inductor"; tests trace with "aot_eager", which runs the
    captured forward and backward graphs op by op and so checks capture without code generation).
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `layers` to compile (expected a HybridLM)")
    _configure_compiler()
    for layer in layers:
        layer.compile(backend=backend, dynamic=False)
    return len(layers)


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` was compiled in place (`nn.Module.compile`)."""
    return getattr(module, "_compiled_call_impl", None) is not None
