"""Capture what a teacher's attention layers see and produce during a forward, via hooks.

`capture_layers(model, layers, fn)` runs `fn(layer_index, LayerIO)` inside the forward of each
selected layer's mixer, then stops the forward after the last selected layer (the LM head and the
layers above are not needed). Works on `HybridLM` and on any module list of `DecoderLayer`s
whose mixer is called as `mixer(x, position_ids, doc_ids, cache)`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass
class LayerIO:
    """One layer's view of a batch. resid [B, T, hidden] residual stream entering the layer;
    x [B, T, hidden] mixer input (after input_norm); out [B, T, hidden] mixer output (attention
    after o_proj); position_ids / doc_ids [B, T]; mixer: the teacher's attention module;
    heads [B, T, H*D] the per-head attention output entering o_proj (the teacher's dtype; under
    tensor parallelism this rank's heads only), None where the mixer has no o_proj module."""

    resid: torch.Tensor
    x: torch.Tensor
    out: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    mixer: nn.Module
    heads: torch.Tensor | None = None


class _StopForward(Exception):
    pass


@contextmanager
def _hooks(model: nn.Module, layers: list[int], fn: Callable[[int, LayerIO], None]) -> Iterator[None]:
    handles = []
    resid: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    last = max(layers)
    for index in layers:
        layer = model.layers[index]

        def pre(module, args, kwargs, index=index):
            resid[index] = args[0] if args else kwargs["x"]

        def pre_o_proj(module, args, index=index):  # the heads the forward made: no recompute later
            heads[index] = args[0]

        def post(module, args, kwargs, output, index=index):
            names = ("x", "position_ids", "doc_ids", "cache")
            given = dict(zip(names, args)) | kwargs
            io = LayerIO(resid.pop(index), given["x"], output, given["position_ids"], given.get("doc_ids"), module,
                         heads.pop(index, None))
            fn(index, io)
            if index == last:
                raise _StopForward

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.mixer.register_forward_hook(post, with_kwargs=True))
        if isinstance(getattr(layer.mixer, "o_proj", None), nn.Module):
            handles.append(layer.mixer.o_proj.register_forward_pre_hook(pre_o_proj))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_layers(
    model: nn.Module, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, layers: list[int],
    fn: Callable[[int, LayerIO], None],
) -> None:
    """Run the teacher on input_ids [B, T] (doc_ids [B, T] packed documents) and call
    fn(layer, io) for every layer in `layers`, in order; stop after the last one."""
    if not layers:
        return
    device = next(model.parameters()).device  # batches may come from the CPU data pipeline
    input_ids = input_ids.to(device)
    doc_ids = None if doc_ids is None else doc_ids.to(device)
    with _hooks(model, sorted(layers), fn):
        try:
            model(input_ids, doc_ids=doc_ids)
        except _StopForward:
            pass
