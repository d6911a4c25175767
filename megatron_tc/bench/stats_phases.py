"""Where the time of the pipeline's statistics pass goes (tools/bench/stats.py --phases): in one
process, variants timed in turn (alternating, so a drifting machine shifts them alike), each as
min / median / max over the repeats, beside a plain teacher forward timed in the same loop:

    collect_stats:            the pass as the pipeline runs it, with its two phases timed apart
                              (sweep 1 with the teacher forward, sweep 2: each ends with a device sync);
    ..., CUDA graphs:         the same with the per-layer CUDA graphs ($MEGATRON_TC_STATS_GRAPHS=1);
    ..., a readout call per layer: sweep 2's layers summed one per call, not in the groups
                              `readout_windows` makes (as few as fit READOUT_GROUP_BYTES, of equal size);
    ..., groups of the cap:   sweep 2's groups as many layers as fit, then the rest (22 layers: 18
                              and 4), not equal ones (11 and 11);
    ..., fp32 projections:    sweep 2's q/k/v projections as fp32 GEMMs, not the 16-bit GEMMs with fp32
                              output that a 16-bit teacher's copied weights get (`readout.wide_linear`);
    sweep 1 alone:            `collect_attention_stats`, nothing kept for sweep 2;
    sweep 1, layer I/O kept:  the same, keeping each layer's input, output and heads as collect_stats does;
    sweep 1, a call per layer: sweep 1 alone with each layer's sums in a call of its own (not stacked).

Sweep 1 inside collect_stats against sweep 1 alone tells what running the pass as one costs it.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Callable
from unittest.mock import patch

import torch
from tqdm.auto import tqdm

from megatron_tc.bench.common import spread, sync, time_once
from megatron_tc.calibrate import readout_mixers, stats as stats_module
from megatron_tc.bench.stats_run import env
from megatron_tc.calibrate.graphs import GRAPHS_ENV

PHASES = ("collect_attention_stats", "collect_readout_stats")


@contextlib.contextmanager
def phase_clock(device: torch.device, into: dict[str, float]):
    """Inside: each call of the statistics module's two sweeps adds its milliseconds (a device sync
    before and after) to into[name]."""
    saved = {name: getattr(stats_module, name) for name in PHASES}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            holder = {}
            into[name] = into.get(name, 0.0) + time_once(lambda: holder.setdefault("out", fn(*args, **kwargs)), device)
            return holder["out"]
        return run

    for name, fn in saved.items():
        setattr(stats_module, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(stats_module, name, fn)


def bench_phases(teacher, batches, layers, meta: dict, strategies, student_arch, chunk_size: int, repeats: int,
                 device: torch.device, on_round: Callable[[list[dict[str, Any]]], None] | None = None
                 ) -> list[dict[str, Any]]:
    """Rows {pass, ms: spread, ratio: median over the forward's median, repeats, [sweep 1 ms, sweep 2 ms]}.
    on_round: called with the rows so far after every round (a run cut short keeps its rounds)."""

    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                teacher(batch["input_ids"])

    def one_pass() -> None:
        stats_module.collect_stats(teacher, batches, layers, meta, readout_strategies=strategies,
                                   student_arch=student_arch, chunk_size=chunk_size, progress=False)

    def sweep1(keep: bool, layers_per_call: int | None = None) -> Callable[[], None]:
        return lambda: stats_module.collect_attention_stats(teacher, batches, layers, meta, chunk_size=chunk_size,
                                                            progress=False, keep_io=[] if keep else None,
                                                            layers_per_call=layers_per_call)

    def with_graphs() -> None:
        with env(GRAPHS_ENV, "1"):
            one_pass()

    def one_pass_with(owner, name: str, value) -> Callable[[], None]:
        """`one_pass` with owner.name set to `value` (restored after)."""
        def run() -> None:
            with patch.object(owner, name, value):
                one_pass()
        return run

    per_layer = one_pass_with(stats_module, "readout_stacked_layers", lambda tokens, per_token: 1)
    groups_of_the_cap = one_pass_with(stats_module, "readout_windows", lambda layers, per_call: [
        list(layers[i:i + per_call]) for i in range(0, len(layers), per_call)])
    fp32_projections = one_pass_with(readout_mixers, "NARROW_DTYPES", ())  # every readout mixer weight in fp32

    variants = {"teacher forward": forward, "collect_stats": one_pass, "collect_stats, CUDA graphs": with_graphs,
                "collect_stats, a readout call per layer": per_layer,
                "collect_stats, groups of the cap": groups_of_the_cap,
                "collect_stats, fp32 projections": fp32_projections,
                "sweep 1 alone": sweep1(False), "sweep 1, layer I/O kept": sweep1(True),
                "sweep 1, a call per layer": sweep1(False, 1)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in variants if name.startswith("collect_stats")}
    for name, fn in tqdm(variants.items(), desc="phases: warm-up", unit="variant"):  # kernels compiled, caches filled
        fn()
    sync(device)
    for _ in tqdm(range(repeats), desc="phases: rounds", unit="round"):
        for name, fn in variants.items():
            split: dict[str, float] = {}
            with phase_clock(device, split) if name in phases else contextlib.nullcontext():
                times[name].append(time_once(fn, device))
            if name in phases:
                phases[name].append(split)
        if on_round is not None:
            on_round(_rows(times, phases))
    return _rows(times, phases)


def _rows(times: dict[str, list[float]], phases: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """One row per variant over the rounds so far: ms and the sweeps' ms as spreads, the ratio of
    medians to the forward's, the number of rounds."""
    base = statistics.median(times["teacher forward"])
    rows = []
    for name, values in times.items():
        row = {"pass": name, "ms": spread(values), "ratio": statistics.median(values) / base, "repeats": len(values)}
        if name in phases:
            row["sweep 1 ms"] = spread([p["collect_attention_stats"] for p in phases[name]])
            row["sweep 2 ms"] = spread([p.get("collect_readout_stats", 0.0) for p in phases[name]])
        rows.append(row)
    return rows
