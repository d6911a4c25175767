"""Sweep 1 of the statistics pass: the Taylor moments of every selected attention layer, summed in
fp64 per layer and head while the teacher runs forward (`stats.collect_attention_stats` drives it
batch by batch and reduces the result).

The sums of several layers of a batch run as one call, their heads stacked (`moments.split_layers`):
the host issues one layer's operators for several (on a GPU it is the bound: a few hundred small
kernels a layer). Layers of another kind (a sliding window among full layers) get calls of their
own.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from .capture import LayerIO, capture_layers
from .graphs import LayerGraphs, graphs_allowed
from .moments import add_into, attention_sums, empty_layer_sums, layers_input_sums, split_layers
from .readout import concat
from .readout_mixers import model_device

IO_WIDTH = 6  # tensors per layer in a call: x, resid, out, q, k, v


class AttentionSweep:
    """Per-layer attention sums over the batches given to `add_batch`.

    model: the teacher (tensor-parallel over `tp_group` when given: each rank sums its own heads).
    keep_io: a list that gets, per batch, {layer: LayerIO} of the selected layers (resid dropped;
    the attention's per-head output kept without TP), for sweep 2.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], *, chunk_size: int,
                 tp_group: dist.ProcessGroup | None, keep_io: list[dict[int, LayerIO]] | None):
        arch = model.arch
        self.model, self.layers, self.chunk_size, self.keep_io = model, list(layers), chunk_size, keep_io
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        heads, kv_heads = arch.num_heads // self.tp, arch.num_kv_heads // self.tp
        device = model_device(model)
        self.sums = dict(zip(self.layers, empty_layer_sums(heads, kv_heads, arch.head_dim, arch.hidden_size, device,
                                                           layers=len(self.layers))))
        # a function of its arguments and the chunk size alone (captured graphs call it on static
        # copies), and no reference back to the sweep, which would then outlive the pass
        self.graphs = LayerGraphs(functools.partial(attention_layer_sums, chunk_size),
                                  enabled=graphs_allowed(tp_group))
        self.pending: dict[tuple, list[tuple[int, LayerIO]]] = {}  # per kind of call, layers waiting
        self.per_call = 1

    def add_batch(self, batch: dict[str, torch.Tensor], per_call: int) -> None:
        """One teacher forward over `batch` (input_ids [B, T], optional doc_ids [B, T]), its
        layers' sums made `per_call` layers at a time as the forward reaches them."""
        self.per_call = per_call
        if self.keep_io is not None:
            self.keep_io.append({})
        capture_layers(self.model, batch["input_ids"], batch.get("doc_ids"), self.layers, self._on_layer, inner=True)

    def _on_layer(self, index: int, io: LayerIO) -> None:
        waiting = self.pending.setdefault(call_kind(io), [])
        waiting.append((index, io))
        if len(waiting) >= self.per_call:
            self._flush(waiting)
        if index == self.layers[-1]:
            for rest in self.pending.values():
                if rest:
                    self._flush(rest)
            self.pending.clear()
        if self.keep_io is not None:  # a TP rank's heads are not the whole layer's: sweep 2 recomputes them
            self.keep_io[-1][index] = dataclasses.replace(io, resid=None, qkv=None,
                                                          heads=io.heads if self.tp == 1 else None)

    @record_function("stats.sweep1.sums")
    def _flush(self, waiting: list[tuple[int, LayerIO]]) -> None:
        ios = [io for _, io in waiting]
        run = self.graphs if ios[0].doc_ids is None else self.graphs.eager  # documents: host syncs (segment bounds)
        tensors = [ios[0].position_ids, ios[0].doc_ids]
        for io in ios:
            tensors += [io.x, io.resid, io.out, *(io.qkv if io.qkv is not None else (None,) * 3)]
        got = run([io.mixer for io in ios], tensors)  # {(i, key): the i-th layer's sum}
        add_into({(i, key): self.sums[waiting[i][0]][key] for i, key in got}, got)  # one add for the call
        waiting.clear()

    def close(self) -> dict[str, torch.Tensor]:
        """The sums, flat: `layers.{l}.{key}`."""
        self.graphs.close()
        return {f"layers.{l}.{k}": v for l, layer_sums in self.sums.items() for k, v in layer_sums.items()}


def attention_layer_sums(chunk_size: int, modules: Sequence[nn.Module], tensors: Sequence, spec
                         ) -> dict[tuple[int, str], torch.Tensor]:
    """modules: the attention of each layer of a call (one or more, same scale and window);
    tensors: position_ids, doc_ids, then per layer x, resid, out, q, k, v as the forward made
    them (or Nones). Returns {(i, key): sum} for the call's i-th layer."""
    position_ids, doc_ids = tensors[0], tensors[1]
    per_layer = [tensors[2 + i * IO_WIDTH:2 + (i + 1) * IO_WIDTH] for i in range(len(modules))]
    qkv = [io[3:] if io[3] is not None else mixer.project_qkv(io[0], position_ids)
           for mixer, io in zip(modules, per_layer)]
    first = modules[0]
    o_weight = torch.cat([mixer.o_proj.weight for mixer in modules], dim=1)  # heads stacked as q's are
    head_sums, _ = attention_sums(*(concat([t[i] for t in qkv], 1) for i in range(3)), first.scale, o_weight,
                                  doc_ids, first.sliding_window, chunk_size)
    inputs = layers_input_sums(*([io[j] for io in per_layer] for j in range(3)), doc_ids, first.sliding_window)
    result = {}
    for i, (part, layer_inputs) in enumerate(zip(split_layers(head_sums, len(modules)), inputs)):
        result.update({(i, key): value for key, value in (part | layer_inputs).items()})
    return result


def call_kind(io: LayerIO) -> tuple:
    """What layers of a batch must share to run in one stacked sweep-1 call: the kind of attention
    (scale, window, shapes, dtypes), positions and documents (the batch's: the same tensors at every
    layer), and whether the forward's q/k/v came with them."""
    mixer, weight = io.mixer, io.mixer.o_proj.weight
    return (type(mixer), mixer.scale, mixer.sliding_window, tuple(weight.shape), weight.dtype, io.x.dtype,
            id(io.position_ids), id(io.doc_ids), io.qkv is None)
