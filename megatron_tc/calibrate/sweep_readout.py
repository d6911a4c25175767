"""Sweep 2 of the statistics pass: each strategy's closed-form GDN layer run on the teacher's input
to that layer, its least-squares readout terms summed in fp64 (`stats.collect_readout_stats` drives
it and reduces the result).

Readout sums need whole layers: with a tensor-parallel teacher each layer's attention is gathered
(`whole_mixer`) and the layers are dealt over the group's ranks (the i-th selected layer to rank
i mod TP, which keeps its gathered attention while it sums); the all-reduce over the group that
follows gives every rank all layers' sums, bit for bit those of one rank doing every layer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from megatron_tc.model.gdn import GatedDeltaNet
from megatron_tc.model.ops.gated_delta_rule import PackedRows

from .capture import LayerIO, capture_layers, merge_layer_io
from .graphs import LayerGraphs, graphs_allowed
from .moments import add_into, zero_views
from .readout import layers_readout_sums, readout_sum_shapes
from .readout_mixers import (
    device_tensors, layer_context, mixer_with, model_device, shell_like, teacher_heads, to_device_each,
)
from .statsfile import TaylorStats
from .strategies import Strategy, default_gdn_state


def whole_mixer(model: nn.Module, index: int, tp_group: dist.ProcessGroup | None) -> nn.Module:
    """Layer `index`'s teacher attention whole on this rank: the layer itself, or with a
    tensor-parallel teacher a single-device copy gathered over `tp_group` (one layer's weights)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return model.layers[index].mixer
    from megatron_tc.parallel.sharded_teacher import full_mixer

    return full_mixer(model, index, tp_group)


class ReadoutSweep:
    """The readout sums of every closed form and layer of `stats` (sweep 1's result), in `part`.

    closed_forms: {readout name: the strategy whose closed form it runs}. Layers are built
    (`build`: the teacher's attention gathered, the default init drawn, each closed form's mixer
    made) before their sums are queued (`sum_kept_window` or `sum_batches`).
    """

    def __init__(self, stats: TaylorStats, model: nn.Module, closed_forms: dict[str, Strategy], student_arch, *,
                 seed: int, tp_group: dist.ProcessGroup | None):
        self.stats, self.model, self.closed_forms = stats, model, closed_forms
        self.student_arch, self.seed, self.tp_group = student_arch, seed, tp_group
        self.names = list(closed_forms)
        # the sums after o_proj only where a strategy reads them (the sums of a readout name serve
        # every strategy sharing it: its closed form's strategy decides)
        self.products = {name: strategy.readout_products for name, strategy in closed_forms.items()}
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        rank = dist.get_rank(tp_group) if self.tp > 1 else 0
        self.mine = {index for i, index in enumerate(stats.layers) if i % self.tp == rank}
        self.mixers: dict[str, dict[int, tuple[GatedDeltaNet, list]]] = {name: {} for name in closed_forms}
        self.teacher_mixers: dict[int, nn.Module] = {}
        self.part: dict[str, torch.Tensor] = {}
        # a function of its arguments and the configuration alone (captured graphs call it on
        # static copies), and no reference back to the sweep, which would then outlive the pass
        self.graphs = LayerGraphs(functools.partial(readout_layer_sums, tuple(self.names), dict(self.products)),
                                  enabled=graphs_allowed(tp_group))

    def candidates(self, name: str, index: int) -> int:
        """Output-gate candidates of closed form `name` at built layer `index`."""
        return len(self.mixers[name][index][1])

    @record_function("stats.sweep2.closed_form")
    def build(self, indices: Sequence[int], shells: Sequence[int] = ()) -> None:
        """Make the readout mixers of layers `indices` (a collective under TP: every rank, every
        layer), the device's share of their closed forms in one copy. shells: built layers whose
        readout mixers take these layers' parameters, position by position (their sums are
        queued); the layers past them get new modules."""
        if not indices:
            return
        arch, device = self.model.arch, model_device(self.model)
        contexts = []  # one default init per layer for every closed form
        for index in indices:
            self.teacher_mixers[index] = whole_mixer(self.model, index, self.tp_group)
            default = default_gdn_state(self.student_arch, index, self.seed)
            contexts.append(layer_context(self.stats, self.model, self.student_arch, index, self.seed,
                                          self.teacher_mixers[index], default))
            if index not in self.mine:
                del self.teacher_mixers[index]
        made = []  # (name, position in the group, parameters, candidates)
        for name, strategy in self.closed_forms.items():  # the group's layers together (`Strategy.closed_forms`)
            for position, (ctx, params) in enumerate(zip(contexts, strategy.closed_forms(contexts))):
                made.append((name, position, params, strategy.gate_candidates(ctx, params)))
        moved = to_device_each([device_tensors(params, candidates) for _, _, params, candidates in made], device)
        for (name, position, params, candidates), moved_here in zip(made, moved):
            into = self.mixers[name][shells[position]][0] if position < len(shells) else self.new_shell(name)
            self.mixers[name][indices[position]] = mixer_with(self.closed_forms[name], self.student_arch,
                                                              indices[position], params, candidates, moved_here, into)
        for name in self.names:  # zero sums of the layers, one buffer per closed form
            shapes = readout_sum_shapes(self.candidates(name, indices[0]), arch.num_heads, self.products[name])
            for index, empty in zip(indices, zero_views(shapes, device, copies=len(indices))):
                self.part.update({f"readout.{name}.layers.{index}.{k}": v for k, v in empty.items()})

    def new_shell(self, name: str) -> GatedDeltaNet | None:
        """A module for a new readout mixer of closed form `name`: the structure of one already
        built (`shell_like`), or None (the first: `mixer_with` constructs it)."""
        built = self.mixers[name]
        return shell_like(next(iter(built.values()))[0]) if built else None

    @record_function("stats.sweep2.sums")
    def queue(self, indices: list[int], ios: list[LayerIO]) -> None:
        """Queue the sums of `indices` (this rank's built layers) over the same rows, their `ios`."""
        modules, tensors = [], [ios[0].position_ids, ios[0].doc_ids]
        for index, io in zip(indices, ios):
            modules += [self.teacher_mixers[index], *(self.mixers[name][index][0] for name in self.names)]
            tensors += [io.x, io.out, io.heads if self.tp == 1 else None,
                        *(c for name in self.names for c in self.mixers[name][index][1])]
        counts = tuple(self.candidates(name, indices[0]) for name in self.names)
        run = self.graphs if ios[0].doc_ids is None else self.graphs.eager  # documents: host syncs (segment bounds)
        got = run(modules, tensors, (len(indices), counts))
        add_into({key: self.part[f"readout.{key[1]}.layers.{indices[key[0]]}.{key[2]}"] for key in got}, got)

    def sum_kept_window(self, window: list[int], next_window: list[int], layer_io: Sequence[dict[int, LayerIO]],
                        merge: int, layouts: list[PackedRows | None]) -> None:
        """Queue the sums of the built layers `window` over the kept batches `layer_io`, merged
        into calls of up to `merge` tokens; then build `next_window` into this window's mixers (the
        host's closed forms overlap the device's sums). layouts: per group of merged rows, fla's
        segment layout (the same rows at every layer: read on the host once), filled as met."""
        ours = [index for index in window if index in self.mine]
        groups = [merge_layer_io([kept[index] for kept in layer_io], merge) for index in ours]
        for group, ios in enumerate(zip(*groups)):
            if group == len(layouts):
                layouts.append(None if ios[0].doc_ids is None else PackedRows.of(ios[0].doc_ids))
            if layouts[group] is not None:
                ios = [dataclasses.replace(io, doc_ids=layouts[group]) for io in ios]
            self.queue(ours, list(ios))
        if next_window:  # under TP collectives: every rank in the same order
            self.build(next_window, shells=window)
        for index in window:
            self.teacher_mixers.pop(index, None)  # a gathered layer lives while its sums are made

    def sum_batches(self, batches: Iterable[dict[str, torch.Tensor]]) -> None:
        """A teacher forward per batch, each layer's sums queued as it is reached (every layer
        built first)."""
        for batch in batches:
            capture_layers(self.model, batch["input_ids"], batch.get("doc_ids"), self.stats.layers,
                           lambda index, io: self.queue([index], [io]) if index in self.mine else None, inner=True)

    def close(self) -> dict[str, torch.Tensor]:
        """The sums in strategy-major order: `readout.{name}.layers.{l}.{key}`."""
        self.graphs.close()
        prefixes = [f"readout.{name}.layers.{index}" for name in self.closed_forms for index in self.stats.layers]
        place = {prefix: i for i, prefix in enumerate(prefixes)}
        layer_of = {key: key.rpartition(".")[0] for key in self.part}
        ours = sorted((key for key in self.part if layer_of[key] in place), key=lambda key: place[layer_of[key]])
        return {key: self.part[key] for key in ours}  # a stable sort: each layer's sums in their order

    def meta(self) -> dict[str, dict]:
        """Per readout name: its candidates and whether the sums after o_proj are there."""
        return {name: {"candidates": len(next(iter(per_layer.values()))[1]), "products": self.products[name]}
                for name, per_layer in self.mixers.items()}


def readout_layer_sums(names: Sequence[str], products: dict[str, bool], modules: Sequence[nn.Module],
                       tensors: Sequence, spec) -> dict[tuple[int, str, str], torch.Tensor]:
    """The sums of L layers over the same rows, spec = (L, candidates per closed form). modules:
    per layer its teacher attention, then a readout mixer per closed form; tensors:
    position_ids, doc_ids, then per layer x, out, heads (the kept per-head output [B, T, H*D] or
    None) and each closed form's candidates. Returns {(i, name, key): sum} of the i-th layer."""
    layers, counts = spec
    position_ids, doc_ids = tensors[:2]
    raw_doc_ids = doc_ids.doc_ids if isinstance(doc_ids, PackedRows) else doc_ids
    width_m, width_t = 1 + len(names), 3 + sum(counts)
    own = [(modules[i * width_m:(i + 1) * width_m], tensors[2 + i * width_t:2 + (i + 1) * width_t])
           for i in range(layers)]
    xs, outs = [t[0] for _, t in own], [t[1] for _, t in own]
    ys = [teacher_heads(m[0], t[0], position_ids, raw_doc_ids, t[2]) for m, t in own]
    o_weights = [m[0].o_proj.weight for m, _ in own]
    result, start = {}, 3
    for j, (name, count) in enumerate(zip(names, counts)):
        got = layers_readout_sums([m[1 + j] for m, _ in own], [list(t[start:start + count]) for _, t in own],
                                  xs, ys, outs, o_weights, doc_ids, products[name])
        result.update({(i, name, key): value for i, sums in enumerate(got) for key, value in sums.items()})
        start += count
    return result
