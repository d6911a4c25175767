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
    tensor parallelism this rank's heads only), None where the mixer has no o_proj module;
    qkv: (q, k, v) as the forward's `mixer.project_qkv` returned them, None where it made none."""

    resid: torch.Tensor
    x: torch.Tensor
    out: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    mixer: nn.Module
    heads: torch.Tensor | None = None
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class _StopForward(Exception):
    pass


@contextmanager
def _hooks(model: nn.Module, layers: list[int], fn: Callable[[int, LayerIO], None], inner: bool) -> Iterator[None]:
    handles = []
    resid: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    qkv: dict[int, tuple] = {}
    wrapped: list[nn.Module] = []
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
                         heads.pop(index, None), qkv.pop(index, None))
            fn(index, io)
            if index == last:
                raise _StopForward

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.mixer.register_forward_hook(post, with_kwargs=True))
        if inner and isinstance(getattr(layer.mixer, "o_proj", None), nn.Module):
            handles.append(layer.mixer.o_proj.register_forward_pre_hook(pre_o_proj))
        if inner and callable(getattr(layer.mixer, "project_qkv", None)) and "project_qkv" not in vars(layer.mixer):
            _record_qkv(layer.mixer, index, qkv)
            wrapped.append(layer.mixer)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for mixer in wrapped:
            del mixer.project_qkv  # the class's method again


def _record_qkv(mixer: nn.Module, index: int, into: dict[int, tuple]) -> None:
    """Shadow `mixer.project_qkv` with one that also stores its result in into[index] (the
    forward's q/k/v: the statistics reuse them instead of projecting again)."""
    method = mixer.project_qkv

    def project_qkv(x, position_ids):
        into[index] = method(x, position_ids)
        return into[index]

    mixer.project_qkv = project_qkv


@torch.no_grad()
def capture_layers(
    model: nn.Module, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, layers: list[int],
    fn: Callable[[int, LayerIO], None], inner: bool = False,
) -> None:
    """Run the teacher on input_ids [B, T] (doc_ids [B, T] packed documents) and call
    fn(layer, io) for every layer in `layers`, in order; stop after the last one. inner: also
    record what the attention made inside (LayerIO.qkv and heads; else None)."""
    if not layers:
        return
    device = next(model.parameters()).device  # batches may come from the CPU data pipeline
    input_ids = input_ids.to(device)
    doc_ids = None if doc_ids is None else doc_ids.to(device)
    with _hooks(model, sorted(layers), fn, inner):
        try:
            model(input_ids, doc_ids=doc_ids)
        except _StopForward:
            pass


def merge_layer_io(ios: list[LayerIO], max_tokens: int) -> list[LayerIO]:
    """One layer's kept views of consecutive batches, concatenated along the rows into as few as
    fit `max_tokens` tokens each (a batch larger than that stays alone): one sweep-2 call per
    group instead of one per batch. Batches join only when their lengths, dtypes and whether they
    carry doc_ids / heads agree; resid is dropped; position_ids come out [rows, T]."""
    groups: list[list[LayerIO]] = []
    tokens = 0
    for io in ios:
        n = io.x.shape[0] * io.x.shape[1]
        if groups and tokens + n <= max_tokens and _joinable(groups[-1][0], io):
            groups[-1].append(io)
            tokens += n
        else:
            groups.append([io])
            tokens = n
    return [group[0] if len(group) == 1 else _concat(group) for group in groups]


def _joinable(a: LayerIO, b: LayerIO) -> bool:
    return (a.x.shape[1:] == b.x.shape[1:] and a.x.dtype == b.x.dtype and a.out.dtype == b.out.dtype
            and (a.doc_ids is None) == (b.doc_ids is None) and (a.heads is None) == (b.heads is None)
            and a.mixer is b.mixer)


def _concat(group: list[LayerIO]) -> LayerIO:
    cat = lambda name: torch.cat([getattr(io, name) for io in group])  # noqa: E731
    positions = torch.cat([io.position_ids.expand(io.x.shape[0], -1) for io in group])
    return LayerIO(None, cat("x"), cat("out"), positions, None if group[0].doc_ids is None else cat("doc_ids"),
                   group[0].mixer, None if group[0].heads is None else cat("heads"))
