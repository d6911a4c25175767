"""The statistics pass: teacher forward over calibration data, fp64 sums per layer and head.

    stats = collect_stats(teacher, batches, layers, meta=..., dp_group=..., readout_strategies=[...])

Sweep 1 (attention, `sweep_attention.AttentionSweep`) sums the Taylor moments of docs/method.md
section 3 for every layer in `layers`. Sweep 2 (readout, `sweep_readout.ReadoutSweep`, only when
strategies ask for it) runs each strategy's closed-form GDN layer on the teacher's input to that
layer and sums its least-squares readout terms. Each rank passes its own batches; one
all-reduce(SUM) over `dp_group` per sweep makes the result equal to a single process over the
union of the data. With tensor parallelism each rank measures its own heads
and `gather_tp_heads` concatenates them into global heads before saving.

Sweep 2 needs sweep 1's reduced sums (the closed forms come from them), so it cannot run inside
the same forward; it needs only each layer's input, output and attention heads (what the forward
fed o_proj, kept so sweep 2 never recomputes the attention), though. `collect_stats` keeps those
from sweep 1's forward when they fit `io_cache_budget` (a quarter of the GPU, a tenth of the RAM)
and sweep 2 reads them instead of running the teacher again: one teacher forward per batch in all,
the same sums bit for bit. Reading kept layers, sweep 2 goes a group of layers at a time, so the
host's work on the next group's closed forms (and the default inits they start from: a few CPU
draws) overlaps the device's sums of this one: that work never waits for the device (no copies to
the CPU; a group's parameters in one asynchronous copy to it).
The closed forms run on the calling thread: on a second host thread (many small operators, each
taking the interpreter lock) the one-forward pass measured twice as slow on an H200 as the
two-forward one. Sweep 1 sums several layers of a batch in one call, their heads stacked (fewer,
larger kernels: the host's launches bound it on a GPU). Each sweep's work for one call and batch
goes through `graphs.LayerGraphs` (eager unless $MEGATRON_TC_STATS_GRAPHS=1).
Under torch.profiler the pass's phases are ranges: `stats.sweep1.sums` (a stacked call of sweep 1,
inside the teacher forward), `stats.sweep1.finish`, `stats.sweep2.closed_form` (a group of
layers' readout mixers), `stats.sweep2.sums` (a call's readout sums) and `stats.sweep2.finish` (the
reductions and the copy to the CPU).
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from megatron_tc.parallel.comm import all_gather, all_ranks

from .capture import LayerIO
from .moments import LAYER_KEYS
from .readout_mixers import (  # noqa: F401 (pack_to, readout_mixer, teacher_heads: the pass's API)
    model_device, move_packed, pack_to, readout_closed_forms, readout_mixer, teacher_heads,
)
from .statsfile import TaylorStats
from .strategies import Strategy
from .sweep_attention import AttentionSweep
from .sweep_readout import ReadoutSweep

Batch = dict[str, torch.Tensor]


def _progress(iterable, total: int | None, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from megatron_tc.monitor import progress

    return progress(iterable, total=total, desc=desc, unit="batch")


def _rank0(group) -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _to_cpu(stats: TaylorStats) -> TaylorStats:
    """A finished pass hands out CPU tensors (as `TaylorStats.load` does): one copy per dtype of
    all sums flattened together, not one wait for the device per sum (800 of them for SmolLM2);
    the sums are views of one buffer per dtype, and a file saved from them holds each value once."""
    stats.sums = move_packed(stats.sums, torch.device("cpu"))
    return stats


def collect_attention_stats(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: Sequence[int],
    meta: dict,
    *,
    chunk_size: int = 128,
    dp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    num_batches: int | None = None,
    progress: bool = True,
    keep_io: list[dict[int, LayerIO]] | None = None,
    layers_per_call: int | None = None,
) -> TaylorStats:
    """Sweep 1. batches: dicts with input_ids [B, T] and optional doc_ids [B, T] (this rank's
    share). meta: at least teacher_sha256, seq_len; completed with the layers and shapes.
    tp_group: the model is tensor-parallel (parallel.tensor_parallel.apply_tensor_parallel) over this group; each
    rank measures its own heads and the result holds global heads. keep_io: a list that gets, per
    batch, {layer: LayerIO} of the selected layers (resid dropped; the attention's per-head output
    kept without TP), for `collect_readout_stats`.

    The sums of several layers of a batch run as one call, their heads stacked (`moments.split_layers`):
    the host issues one layer's operators for several (on a GPU it is the bound: a few hundred small
    kernels a layer); layers of another kind (a sliding window among full layers) get calls of
    their own. layers_per_call: at most this many (default `stacked_layers`: as many as fit
    STACK_BYTES of temporaries); 1 is a call per layer."""
    arch = model.arch
    layers = sorted(layers)
    for index in layers:
        if arch.layer_kinds[index] != "A":
            raise ValueError(f"layer {index} of the teacher is not softmax attention (pattern {arch.layer_pattern!r})")
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp > 1 and dp_group is None:
        raise ValueError("a tensor-parallel teacher needs dp_group (the data-parallel group): None reduces over the "
                         "whole world, which would add up the rows every TP rank sees")
    sweep = AttentionSweep(model, layers, chunk_size=chunk_size, tp_group=tp_group, keep_io=keep_io)
    seq_len = 0
    for batch in _progress(batches, num_batches, "taylor stats", progress and _rank0(dp_group)):
        seq_len = max(seq_len, batch["input_ids"].shape[1])
        shape = batch["input_ids"].shape
        sweep.add_batch(batch, layers_per_call if layers_per_call is not None else stacked_layers(arch, shape, tp))
    with record_function("stats.sweep1.finish"):
        flat = sweep.close()
        full_meta = dict(meta)
        full_meta.update(
            layers=layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            hidden_size=arch.hidden_size, layer_pattern=arch.layer_pattern, chunk_size=chunk_size,
        )
        full_meta.setdefault("seq_len", seq_len)
        full_meta.setdefault("readout", {})
        stats = TaylorStats(full_meta, flat)
        stats.all_reduce_(dp_group)
        if tp > 1:
            gather_tp_heads(stats, tp_group)
        stats = _to_cpu(stats)  # the one wait for the device
        if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
            stats.meta["tokens"] = int(stats.sums[f"layers.{layers[0]}.count"]) if layers else 0
        return stats


STACK_BYTES = 2 << 30  # sweep 1's fp32 / fp64 temporaries of one stacked call, at most


def stacked_layers(arch, batch_shape: Sequence[int], tp: int = 1) -> int:
    """Layers whose sweep-1 sums run in one call for a batch of `batch_shape` [B, T]: their per-head
    temporaries (about 20 bytes per token, head and channel: fp32 outputs, their fp64 copies) within
    STACK_BYTES, and B x heads within the kernel's grid (65,535 rows of programs)."""
    heads = arch.num_heads // tp
    per_layer = 20 * batch_shape[0] * batch_shape[1] * heads * arch.head_dim
    return max(1, min(STACK_BYTES // per_layer, 65535 // (batch_shape[0] * heads)))


def gather_tp_heads(stats: TaylorStats, tp_group: dist.ProcessGroup) -> None:
    """Concatenate every per-head / per-KV-head sum over the TP group (rank order = head order,
    as the column-parallel q/k/v split heads); per-layer sums are identical on all TP ranks."""
    for key in sorted(stats.sums):
        if key.split(".")[-1] in LAYER_KEYS:
            continue
        stats.sums[key] = torch.cat(all_gather(stats.sums[key], tp_group), dim=0)


def collect_readout_stats(
    stats: TaylorStats,
    model: nn.Module,
    batches: Iterable[Batch],
    strategies: Sequence[Strategy],
    student_arch,
    *,
    seed: int = 0,
    dp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    num_batches: int | None = None,
    progress: bool = True,
    layer_io: Sequence[dict[int, LayerIO]] | None = None,
) -> TaylorStats:
    """Sweep 2: add `readout.{strategy}.layers.{l}.*` sums to `stats` (in place, returned).

    tp_group: the teacher is tensor-parallel over it: each layer's attention is gathered whole and
    the layers are dealt over the group's ranks (`sweep_readout`), one all-reduce over the group
    giving every rank every layer's sums.

    layer_io: what sweep 1 kept of these batches (`keep_io`), read instead of a teacher forward.
    Then the sweep goes a group of layers at a time: the host queues their sums over every batch,
    then works out the next group's closed forms (without waiting for the device) while the
    device sums. Consecutive kept batches are concatenated into calls of up to
    `readout_group_tokens` tokens (`capture.merge_layer_io`): a few calls instead of one per batch
    (the pipeline's batches are single rows), and each call sums a group of `readout_windows`
    (equal groups, each at most what `readout_stacked_layers` fits in the same READOUT_GROUP_BYTES),
    their heads stacked
    (`readout.layers_readout_sums`: the recurrence and the reductions issued once for all of them).
    The sums are those of the batch-by-batch, layer-by-layer order up to the fp64 summation order
    and the fp32 rounding of operations on larger tensors (GEMM algorithms, reductions). Packed
    documents: each group's rows are the same at every layer, so their `PackedRows` (fla's segment
    layout, a host read) are made once and serve all of them."""
    closed_forms = readout_closed_forms(strategies)
    if not closed_forms:
        return stats
    sweep = ReadoutSweep(stats, model, closed_forms, student_arch, seed=seed, tp_group=tp_group)
    show = progress and _rank0(dp_group)
    if layer_io is not None:
        layers = list(stats.layers)
        sweep.build(layers[:1])
        per_token = max(readout_bytes_per_token(model.arch, sweep.candidates(name, layers[0]), sweep.products[name])
                        for name in sweep.names)  # the closed forms' calls run one after another
        merge = max(1, READOUT_GROUP_BYTES // per_token)  # readout_group_tokens of the largest
        kept_tokens = sum(kept[layers[0]].x.shape[0] * kept[layers[0]].x.shape[1] for kept in layer_io)
        # a rank without calibration rows (more data-parallel ranks than rows) sums nothing, builds
        # every layer's zero sums all the same and joins the all-reduce
        per_call = readout_stacked_layers(max(1, min(merge, kept_tokens)), per_token)
        windows = readout_windows(layers, per_call)
        sweep.build(windows[0][1:])
        layouts: list = []
        for w, window in enumerate(_progress(windows, len(windows), "readout sums (layer groups)", show)):
            sweep.sum_kept_window(window, windows[w + 1] if w + 1 < len(windows) else [], layer_io, merge, layouts)
    else:
        sweep.build(stats.layers)
        sweep.sum_batches(_progress(batches, num_batches, "readout sums", show))
    with record_function("stats.sweep2.finish"):
        reduced = TaylorStats({"layers": stats.layers}, sweep.close())
        if sweep.tp > 1:
            reduced.all_reduce_(tp_group)  # each layer's sums from the rank that made them
        reduced.all_reduce_(dp_group)
        stats.sums.update(_to_cpu(reduced).sums)
    stats.meta["readout"].update(sweep.meta())
    return stats


def collect_stats(
    model: nn.Module,
    batches: Sequence[Batch],
    layers: Sequence[int],
    meta: dict,
    *,
    readout_strategies: Sequence[Strategy] = (),
    student_arch=None,
    seed: int = 0,
    chunk_size: int = 128,
    dp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    progress: bool = True,
    io_cache_budget: int | None = None,
) -> TaylorStats:
    """Both sweeps over the same batches (a sequence: it may be read twice). With readout strategies,
    sweep 1 keeps every selected layer's input and output when they take at most `io_cache_budget`
    bytes (default `default_io_cache_budget`; 0: never) and sweep 2 reads them: one teacher forward
    per batch. Otherwise sweep 2 runs the teacher again.

    tp_group: the teacher is tensor-parallel over it (parallel.tensor_parallel.apply_tensor_parallel or
    parallel.sharded_teacher). Sweep 1 sums each rank's heads and gathers them into global heads;
    sweep 2 gathers one whole attention layer at a time (never the model). A layer's input and
    output are whole on every rank of the group (the row-parallel o_proj reduces), so kept layers
    serve sweep 2 as they do without TP (but for the attention heads, a rank's own: sweep 2
    recomputes them from the gathered layer). The group keeps them only where they fit every
    rank's budget (its sweep 2 runs collectives together; GPUs may differ)."""
    budget = default_io_cache_budget(model_device(model)) if io_cache_budget is None else io_cache_budget
    fits = bool(readout_strategies) and layer_io_bytes(model, batches, layers) <= budget
    if readout_strategies and tp_group is not None:
        fits = all_ranks(fits, tp_group)
    keep = [] if fits else None
    stats = collect_attention_stats(
        model, batches, layers, meta, chunk_size=chunk_size, dp_group=dp_group, tp_group=tp_group,
        num_batches=len(batches), progress=progress, keep_io=keep,
    )
    if readout_strategies:
        stats = collect_readout_stats(
            stats, model, batches, readout_strategies, student_arch or model.arch, seed=seed, dp_group=dp_group,
            tp_group=tp_group, num_batches=len(batches), progress=progress, layer_io=keep,
        )
    return stats


READOUT_GROUP_BYTES = 2 << 30  # fp32 temporaries of one readout call (merged batches, stacked layers), at most


def readout_bytes_per_token(arch, candidates: int, products: bool = True) -> int:
    """A readout call's largest fp32 temporaries per token and layer: with `products` U [H*C,
    tokens*hidden]; the reads [C + 2, tokens, H, D]."""
    per_head = (candidates * arch.hidden_size if products else 0) + (candidates + 2) * arch.head_dim
    return 4 * arch.num_heads * per_head


def readout_stacked_layers(tokens: int, per_token: int) -> int:
    """Layers whose readout sums run in one call over `tokens` tokens (`per_token` bytes of
    temporaries a token and layer): as many as fit READOUT_GROUP_BYTES, at least one. On a GPU too,
    where the device then waits while the host works out a group's closed forms: the host's
    operators a layer, not the device, bound sweep 2 there, and grouped layers took 0.68x to
    0.97x the time of a call per layer on three H200 machines (docs/benchmarks.md)."""
    return max(1, READOUT_GROUP_BYTES // (tokens * per_token))


def readout_windows(layers: Sequence[int], per_call: int) -> list[list[int]]:
    """Sweep 2's groups of kept layers, in order: as few as hold at most `per_call` layers each, of
    equal size (the last may be smaller). The device waits while the host works out the first
    group's closed forms, so that group is no larger than the others; and each size is a shape of
    the stacked kernels that compile and tune on first use (22 layers, 18 a call: 11 and 11, not
    18 and 4)."""
    if not layers:
        return []
    size = -(-len(layers) // -(-len(layers) // per_call))  # ceil(n / ceil(n / per_call))
    return [list(layers[i:i + size]) for i in range(0, len(layers), size)]


def readout_group_tokens(arch, candidates: int, products: bool = True) -> int:
    """Tokens of kept batches sweep 2 merges into one call of a layer: READOUT_GROUP_BYTES of its
    temporaries (a batch larger than that is never split: it costs what it did alone). The layers
    summed in one call are as many as fit the same bytes with the group's tokens."""
    return READOUT_GROUP_BYTES // readout_bytes_per_token(arch, candidates, products)


def layer_io_bytes(model: nn.Module, batches: Sequence[Batch], layers: Sequence[int]) -> int:
    """Bytes of every selected layer's input, output and per-head attention output over `batches`
    (the sweep-2 cache; the heads counted also under TP, where they are not kept)."""
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    itemsize = next(model.parameters()).element_size()
    arch = model.arch
    return tokens * len(layers) * (2 * arch.hidden_size + arch.num_heads * arch.head_dim) * itemsize


def default_io_cache_budget(device: torch.device) -> int:
    """A quarter of the GPU's memory; on the CPU a tenth of the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10


def log_stats(stats: TaylorStats, writer, step: int = 0) -> None:
    """Per-head statistics to TensorBoard: `stats/L{l}/{name}` plotted against the head index,
    and `stats_layer/{name}` (mean over heads) against the layer index. `writer`: the project's
    TBWriter (`scalar`) or a torch SummaryWriter (`add_scalar`)."""
    log = writer.scalar if hasattr(writer, "scalar") else writer.add_scalar
    names = ("dist", "dist_nosink", "entropy", "conc", "conc_nosink", "sink", "logit_var", "out_energy_o")
    for index in stats.layers:
        sums = stats.layer(index)
        for name in names:
            values = stats.mean(index, name)
            for head, value in enumerate(values.tolist()):
                log(f"stats/L{index:02d}/{name}", value, head)
            log(f"stats_layer/{name}", float(values.mean()), index)
        ratio = float(sums["Y_energy"] / sums["resid_energy"].clamp_min(1e-30))
        log("stats_layer/attn_to_resid_energy", ratio, index)
    writer.flush()


def describe(stats: TaylorStats) -> list[dict]:
    """One row per layer: head-averaged statistics (for printing and reports)."""
    rows = []
    for index in stats.layers:
        row = {"layer": index}
        for name in ("dist", "dist_nosink", "conc", "conc_nosink", "sink", "logit_var"):
            row[name] = round(float(stats.mean(index, name).mean()), 4)
        sums = stats.layer(index)
        row["attn/resid"] = round(float(sums["Y_energy"] / sums["resid_energy"].clamp_min(1e-30)), 5)
        zero_order = sums["zero_order_err"].sum() / sums["out_energy"].sum().clamp_min(1e-30)
        row["zero_order_frac"] = round(float(zero_order), 4)
        rows.append(row)
    return rows


__all__ = ["TaylorStats", "collect_attention_stats", "collect_readout_stats", "collect_stats", "describe", "log_stats"]
