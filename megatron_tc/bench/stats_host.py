"""The host's work in sweep 2 of the statistics pass, per converted layer, measured on the CPU
(tools/bench/stats_host.py): PyTorch operators (counted where they reach the kernels, below
autograd) and CPU time of

    default: the values of one layer's default GDN init (`default_gdn_state`) that its readout
           mixer's closed form reads (not those it replaces, such as the output gate that the
           readout leaves to `finish`), once per layer and pass;
    build: one layer's readout mixer (`calibrate.stats.readout_mixer`: the closed form from the
           teacher's weights, the statistics and that default init), once per layer and pass;
    group build: the readout mixers of `stack` layers built together as sweep 2 builds a group
           (`Strategy.closed_forms`, one copy to the device), per layer;
    sums:  one batch's readout sums of that layer (the GDN recurrence, the fp64 products; the
           teacher's attention heads are those its forward made), once per layer and batch;
    stacked sums: the same of `stack` layers in one `layers_readout_sums` call (their heads
           stacked, as sweep 2 runs the kept layers), per layer: operators and CPU time over `stack`.
    pass, narrow layers: a whole `collect_stats` (both sweeps, one forward) on a teacher of the
           preset's layers and heads at widths where the arithmetic is small next to the host's
           work (head_dim 8), two batches of one row, a quarter of its layers kept as attention;
           beside it the plain forward over the same batches and the pass's CPU time over it. The
           CPU runs the PyTorch references of the kernels a GPU runs, so the pass issues more
           operators here; the bookkeeping between them is the same.

On a GPU the host issues the same operators of `build` (its math runs on the CPU either way) and
those of `sums` with the recurrence through fla instead of the PyTorch chunks counted here.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tc.calibrate.capture import capture_layers
from megatron_tc.calibrate.readout import layers_readout_sums, readout_sums
from megatron_tc.calibrate.readout_mixers import device_tensors, layer_context, mixer_with, to_device_each
from megatron_tc.calibrate.stats import (
    collect_attention_stats, collect_stats, readout_closed_forms, readout_mixer, teacher_heads,
)
from megatron_tc.calibrate.student import converted_layers
from megatron_tc.calibrate.strategies import default_gdn_state, get_strategy
from megatron_tc.model import ArchConfig, HybridLM

from .models import quarter_pattern


class OpCount(TorchDispatchMode):
    """Counts the operators dispatched inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> int:
    with OpCount() as counter:
        fn()
    return counter.count


def cpu_ms(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Process CPU time of `fn` (ms, min / median / max of `repeats` calls after one warm-up):
    CPU time, not wall time, so other processes on the machine change it less."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(1e3 * (time.process_time() - start))
    return {"min": round(min(times), 3), "median": round(statistics.median(times), 3), "max": round(max(times), 3)}


def layer_work(arch: ArchConfig, strategy: str, tokens: int, seed: int = 0):
    """(default, build, group_build(stack), sums, stacked_sums(stack)) of `measure` for layer 1 of a 2-layer teacher of
    `arch`'s layer shape (random
    weights, fp32, one row of `tokens` random ids)."""
    arch = replace(arch, num_layers=2, layer_pattern="AA")
    torch.manual_seed(seed)
    teacher = HybridLM(arch).eval()
    ids = torch.randint(0, arch.vocab_size, (1, tokens))
    stats = collect_attention_stats(teacher, [{"input_ids": ids}], [1], {"teacher_sha256": "bench"}, progress=False)
    (closed_form,) = readout_closed_forms([get_strategy(strategy)]).values()
    kept = {}
    capture_layers(teacher, ids, None, [1], lambda index, io: kept.setdefault(index, io), inner=True)
    io, attention = kept[1], teacher.layers[1].mixer
    student, candidates = readout_mixer(closed_form, stats, teacher, arch, 1, seed)

    ready = default_gdn_state(arch, 1, seed)  # its values drawn by the closed form's first build
    readout_mixer(closed_form, stats, teacher, arch, 1, seed, default=ready, into=student)

    def default():
        state = default_gdn_state(arch, 1, seed)
        return {key: state[key] for key in ready.drawn}

    def build():  # into the previous layer's mixer, as the pass reuses it
        return readout_mixer(closed_form, stats, teacher, arch, 1, seed, default=ready, into=student)

    shells: list = []  # the modules a group fills, made by its first call (the pass reuses them too)

    def group_build(stack: int):  # `stack` copies of the layer, as ReadoutSweep.build makes a group
        contexts = [layer_context(stats, teacher, arch, 1, seed, default=ready) for _ in range(stack)]
        made = [(p, closed_form.gate_candidates(c, p)) for c, p in zip(contexts, closed_form.closed_forms(contexts))]
        moved = to_device_each([device_tensors(p, c) for p, c in made], next(teacher.parameters()).device)
        built = [mixer_with(closed_form, arch, 1, p, c, moved[i], shells[i] if i < len(shells) else None)
                 for i, (p, c) in enumerate(made)]
        shells[len(shells):] = [mixer for mixer, _ in built[len(shells):]]
        return built

    @torch.no_grad()
    def sums():  # what collect_readout_stats runs for one layer and batch (the attention's heads kept)
        y = teacher_heads(attention, io.x, io.position_ids, None, io.heads)
        return readout_sums(student, candidates, io.x, y, io.out, attention.o_proj.weight, None,
                            closed_form.readout_products)

    @torch.no_grad()
    def stacked_sums(stack: int):  # `stack` copies of the layer in one call
        y = teacher_heads(attention, io.x, io.position_ids, None, io.heads)
        return layers_readout_sums([student] * stack, [candidates] * stack, [io.x] * stack, [y] * stack,
                                   [io.out] * stack, [attention.o_proj.weight] * stack, None,
                                   closed_form.readout_products)

    return default, build, group_build, sums, stacked_sums


def measure(arch: ArchConfig, strategy: str, tokens: int, repeats: int, stack: int = 8) -> list[dict]:
    default, build, group_build, sums, stacked_sums = layer_work(arch, strategy, tokens)
    work = (("default", "layer", default), ("build", "layer", build))
    rows = [{"work": name, "per": per, "ops": count_ops(fn), "cpu_ms": cpu_ms(fn, repeats)} for name, per, fn in work]
    grouped = lambda: group_build(stack)  # noqa: E731
    grouped()  # its modules made, as every group after a pass's first finds them
    rows.append({"work": f"build, {stack} layers together", "per": "layer", "ops": round(count_ops(grouped) / stack, 1),
                 "cpu_ms": {k: round(v / stack, 3) for k, v in cpu_ms(grouped, repeats).items()}})
    rows.append({"work": "sums", "per": "layer and batch", "ops": count_ops(sums), "cpu_ms": cpu_ms(sums, repeats)})
    stacked = lambda: stacked_sums(stack)  # noqa: E731
    per_layer = {k: round(v / stack, 3) for k, v in cpu_ms(stacked, repeats).items()}
    rows.append({"work": f"sums, {stack} layers stacked", "per": "layer and batch",
                 "ops": round(count_ops(stacked) / stack, 1), "cpu_ms": per_layer})
    return rows


def narrow(arch: ArchConfig, head_dim: int = 8) -> ArchConfig:
    """`arch`'s layers, heads and KV heads at small widths: head_dim `head_dim`, hidden size
    heads x head_dim, a 256-token vocabulary."""
    hidden = arch.num_heads * head_dim
    return replace(arch, vocab_size=256, hidden_size=hidden, head_dim=head_dim, intermediate_size=2 * hidden)


def pass_work(arch: ArchConfig, strategy: str, tokens: int, seed: int = 0):
    """(forward, collect) of the "pass, narrow layers" rows: the plain forward of a `narrow(arch)`
    teacher over two batches of one row of `tokens` random ids, and `collect_stats` over them with
    `strategy`'s readout (a quarter of the layers kept as attention, the rest converted)."""
    arch = narrow(arch)
    torch.manual_seed(seed)
    teacher = HybridLM(arch).eval()
    pattern = quarter_pattern(arch.num_layers)
    batches = [{"input_ids": torch.randint(0, arch.vocab_size, (1, tokens))} for _ in range(2)]

    @torch.no_grad()
    def forward():
        for batch in batches:
            teacher(batch["input_ids"])

    def collect():
        return collect_stats(teacher, batches, converted_layers(pattern), {"teacher_sha256": "bench"},
                             readout_strategies=[get_strategy(strategy)], student_arch=arch.with_pattern(pattern),
                             seed=seed, progress=False)

    return forward, collect


def measure_pass(arch: ArchConfig, strategy: str, tokens: int, repeats: int) -> list[dict]:
    forward, collect = pass_work(arch, strategy, tokens)
    rows = [{"work": f"{name}, narrow layers", "per": "pass", "tokens": tokens, "ops": count_ops(fn),
             "cpu_ms": cpu_ms(fn, repeats)} for name, fn in (("forward", forward), ("pass", collect))]
    rows[1]["x_forward"] = round(rows[1]["cpu_ms"]["median"] / rows[0]["cpu_ms"]["median"], 2)
    return rows
