"""The statistics-pass benchmark (tools/bench/stats.py): both sweeps of the statistics pass against
a plain teacher forward over the same tokens, checks of the sweep-1 sums, and the calibration wall
time of `taylor_calibrate` (statistics + closed form + per-layer alignment)."""
from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import replace
from typing import Any

import torch

from megatron_tc.config.errors import InputError
from megatron_tc.bench.common import Report, host_syncs, pick_device, profile_rows, rel_err, sync, time_fn
from megatron_tc.bench.models import PRESETS, load_gguf_teacher, quarter_pattern
from megatron_tc.calibrate.graphs import GRAPHS_ENV
from megatron_tc.calibrate.moments import STATS_KERNEL_ENV, use_stats_kernel
from megatron_tc.calibrate.stats import collect_attention_stats, collect_readout_stats, collect_stats
from megatron_tc.calibrate.strategies import get_strategy
from megatron_tc.calibrate.student import calibrate_student, converted_layers
from megatron_tc.model import HybridLM
from megatron_tc.model.gdn import GatedDeltaNet

STATS_GOAL, CALIBRATE_GOAL_S = 1.5, 60.0


def random_batches(vocab: int, rows: int, seq: int, num: int, device) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, vocab, (rows, seq), device=device)} for _ in range(num)]


def packed_batches(vocab: int, rows: int, seq: int, mean_doc: int, device, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`rows` batches of one row [1, seq], input_ids and doc_ids, as a run's calibration source gives
    them: random documents (lengths exponential with mean `mean_doc` tokens, at least 1) packed
    back to back by the run's `pack_window`."""
    import numpy as np

    from megatron_tc.data.packing import TokenStream, pack_window

    gen = np.random.default_rng(seed)
    lengths, total = [], 0
    while total <= rows * seq:
        lengths.append(max(1, int(gen.exponential(mean_doc))))
        total += lengths[-1]
    stream = TokenStream.from_token_lists([gen.integers(0, vocab, n) for n in lengths])
    windows = [pack_window(stream, r * seq, seq, pad_id=0) for r in range(rows)]
    return [{key: torch.as_tensor(w[key], device=device)[None] for key in ("input_ids", "doc_ids")} for w in windows]


def stats_check(teacher: HybridLM, layers: list[int], device, meta: dict, chunk: int) -> dict:
    """Sweep-1 sums on the device (teacher dtype) vs an fp32 CPU copy, one [1, 256] batch."""
    batch = random_batches(teacher.arch.vocab_size, 1, 256, 1, device)
    got = collect_attention_stats(teacher, batch, layers, meta, chunk_size=chunk, progress=False)
    ref_model = copy.deepcopy(teacher).float().cpu()
    ref = collect_attention_stats(ref_model, [{"input_ids": batch[0]["input_ids"].cpu()}], layers, meta,
                                  chunk_size=chunk, progress=False)
    errors = {k: rel_err(got.sums[k].cpu(), v) for k, v in ref.sums.items() if v.abs().sum() > 0}
    worst = max(errors, key=errors.get)
    return {"check": "sweep-1 sums: device vs fp32 CPU", "max_rel_err": errors[worst], "worst": worst,
            "median_rel_err": sorted(errors.values())[len(errors) // 2]}


@contextlib.contextmanager
def env(name: str, value: str):
    """$name=value inside."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def stats_kernel(mode: str):
    """$MEGATRON_TC_STATS_KERNEL=mode inside (auto, triton, reference)."""
    return env(STATS_KERNEL_ENV, mode)


def kernel_check(teacher: HybridLM, layers: list[int], device, meta: dict, chunk: int) -> dict:
    """Sweep-1 sums of one [1, 256] batch: the kernel vs the PyTorch chunks, both on the device."""
    batch = random_batches(teacher.arch.vocab_size, 1, 256, 1, device)
    out = {}
    for mode in ("triton", "reference"):
        with stats_kernel(mode):
            out[mode] = collect_attention_stats(teacher, batch, layers, meta, chunk_size=chunk, progress=False)
    ref = out["reference"].sums
    errors = {k: rel_err(out["triton"].sums[k], v) for k, v in ref.items() if v.abs().sum() > 0}
    worst = max(errors, key=errors.get)
    return {"check": "sweep-1 sums: kernel vs PyTorch chunks (device)", "max_rel_err": errors[worst], "worst": worst,
            "median_rel_err": sorted(errors.values())[len(errors) // 2]}


def graphs_check(replayed, eager) -> dict:
    """The statistics pass with per-layer CUDA graphs against the eager pass (same batches)."""
    errors = {k: rel_err(replayed.sums[k], v) for k, v in eager.sums.items() if v.abs().sum() > 0}
    worst = max(errors, key=errors.get)
    same = sum(torch.equal(replayed.sums[k], v) for k, v in eager.sums.items())
    return {"check": f"collect_stats: CUDA graphs vs eager ({same} of {len(eager.sums)} sums bit-identical)",
            "max_rel_err": errors[worst], "worst": worst, "median_rel_err": sorted(errors.values())[len(errors) // 2]}


def warm_gdn_kernels(arch, layer: int, device, seq: int, align_dtype: torch.dtype = torch.float32) -> float:
    """First use of the GDN kernels outside the timed calibration: the fp32 forward of the readout
    sums, forward + backward in the alignment's dtype; seconds."""
    start = time.perf_counter()
    mixer = GatedDeltaNet(arch, layer).to(device)
    x = torch.randn(2, seq, arch.hidden_size, device=device)
    with torch.no_grad():
        mixer(x)
    mixer.to(align_dtype)
    mixer(x.to(align_dtype)).float().square().mean().backward()
    sync(device)
    return time.perf_counter() - start


class StatsRows:
    """Rows of the statistics benchmark: each pass timed over the same batches, its time also as
    a ratio to the plain teacher forward (the first row)."""

    def __init__(self, teacher, layers, student_arch, args, device, report: Report):
        self.teacher, self.layers, self.student_arch = teacher, layers, student_arch
        self.args, self.device, self.report = args, device, report
        self.batches = random_batches(teacher.arch.vocab_size, args.batch, args.seq, args.num_batches, device)
        self.tokens = args.batch * args.seq * args.num_batches
        self.meta = {"teacher_sha256": "bench", "seq_len": args.seq}
        self.base = {"tokens": self.tokens, "B": args.batch, "T": args.seq, "layers": len(layers), "dtype": args.dtype}
        self.strategies = [get_strategy(s) for s in args.readout.split(",") if s]
        self.forward_ms = 0.0

    def add(self, label: str, ms: float, goal: float | None = None, **extra: Any) -> None:
        """A row of `ms` (with tokens/s and the ratio to the teacher forward; with `goal`, whether
        that ratio meets it)."""
        ratio = ms / self.forward_ms if self.forward_ms else 1.0
        row = {**self.base, "pass": label, **extra, "ms": ms, "tok_per_s": self.tokens / (ms * 1e-3), "ratio": ratio}
        if goal is not None:
            row |= {"goal": f"<= {goal}", "met": ratio <= goal}
        self.report.add("rows", row)

    def timed(self, label: str, fn, goal: float | None = None, **extra: Any) -> float | None:
        """Time `fn` and add its row (`add`); its ms, or None when it failed (the row then says
        so and the report holds the error)."""
        try:
            ms = time_fn(fn, self.device, budget_ms=self.args.budget_ms, max_reps=5).ms
        except Exception as exc:
            self.failed(label, exc, **extra)
            return None
        self.add(label, ms, goal, **extra)
        return ms

    def failed(self, label: str, exc: Exception, **extra: Any) -> None:
        self.report.error(label, exc)
        self.report.add("rows", {**self.base, "pass": label, **extra, "note": f"failed: {type(exc).__name__}"})

    def forward(self) -> None:
        with torch.no_grad():
            for batch in self.batches:
                self.teacher(batch["input_ids"])

    def sweep1(self):
        return collect_attention_stats(self.teacher, self.batches, self.layers, self.meta,
                                       chunk_size=self.args.chunk_size, progress=False)

    def sweep2(self, stats) -> None:
        collect_readout_stats(stats, self.teacher, self.batches, self.strategies, self.student_arch, progress=False)

    def one_forward(self):
        """What the pipeline runs: both sweeps, the teacher forward once per batch."""
        return collect_stats(self.teacher, self.batches, self.layers, self.meta, readout_strategies=self.strategies,
                             student_arch=self.student_arch, chunk_size=self.args.chunk_size, progress=False)


def bench_stats(teacher, layers, student_arch, args, device, report) -> None:
    rows = StatsRows(teacher, layers, student_arch, args, device, report)
    rows.forward_ms = time_fn(rows.forward, device, budget_ms=args.budget_ms, max_reps=10).ms
    rows.add("teacher forward", rows.forward_ms)
    holder = {}
    sweep1 = lambda: holder.__setitem__("stats", rows.sweep1())  # noqa: E731 - sweep 2 reads its result

    def sweep2() -> None:
        if "stats" not in holder:
            raise RuntimeError("sweep 2 needs the statistics of sweep 1, which failed")
        rows.sweep2(holder["stats"])

    impl = "triton" if use_stats_kernel(rows.batches[0]["input_ids"]) else "pytorch"
    passes = [("sweep 1", sweep1)] + ([("sweep 2", sweep2)] if rows.strategies else [])
    times = [rows.timed("stats sweep 1 (attention moments)", sweep1, impl=impl)]
    if rows.strategies:
        times.append(rows.timed(f"stats sweep 2 (readout: {args.readout})", sweep2, impl=None))
    if args.profile and "stats" in holder:
        profile_sweeps(rows, passes)
    if None not in times:
        rows.add("statistics pass (both sweeps)", sum(times), STATS_GOAL)
    if rows.strategies:
        one_forward_rows(rows)
    if args.sweep1_reference:  # the PyTorch chunks, for the kernel's gain (not in the total)
        with stats_kernel("reference"):
            rows.timed("stats sweep 1 (attention moments), PyTorch reference", sweep1, impl="pytorch")


def profile_sweeps(rows: StatsRows, passes: list) -> None:
    """--profile: the operators of each sweep and of the one-forward pass, with the host time of
    each phase of the pass (its `stats.*` profiler ranges), and the host's waits for the device in
    each of them."""
    if rows.strategies:
        passes = passes + [("collect_stats", rows.one_forward)]
    for name, fn in passes:
        for row in profile_rows(fn, rows.device, ranges="stats."):
            rows.report.add("profile", {"pass": name, **row})
    for name, fn in passes:
        syncs = host_syncs(fn, rows.device)
        if syncs:
            rows.report.add("syncs", {"what": name, **syncs})


def one_forward_rows(rows: StatsRows) -> None:
    """The pipeline's pass (one teacher forward a batch), eager and on CUDA with per-layer CUDA
    graphs, the graphs' sums checked against the eager ones."""
    passes = [("statistics pass, one forward (collect_stats)", "0")]
    if rows.device.type == "cuda":
        passes.append(("statistics pass, one forward, CUDA graphs (MEGATRON_TC_STATS_GRAPHS=1)", "1"))
    results = {}
    for label, graphs in passes:
        with env(GRAPHS_ENV, graphs):
            try:
                results[graphs] = rows.one_forward()
            except Exception as exc:
                rows.failed(label, exc)
                continue
            rows.timed(label, rows.one_forward, STATS_GOAL)
    if len(results) == 2:
        rows.report.add("checks", graphs_check(results["1"], results["0"]))


def bench_phases_rows(teacher, layers, student_arch, args, device, report) -> None:
    """--phases: `stats_phases.bench_phases` over the benchmark's batches, one row per variant."""
    from megatron_tc.bench.stats_phases import bench_phases

    batches = random_batches(teacher.arch.vocab_size, args.batch, args.seq, args.num_batches, device)
    strategies = [get_strategy(s) for s in args.readout.split(",") if s]
    meta = {"teacher_sha256": "bench", "seq_len": args.seq}
    def publish(rows: list[dict]) -> None:  # after every round: the JSON holds the rounds so far
        report.data["phases"] = [
            {**{k: (f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" if isinstance(v, dict) else v)
                for k, v in row.items()}, "ratio": round(row["ratio"], 2)} for row in rows]
        report.save()

    bench_phases(teacher, batches, layers, meta, strategies, student_arch, args.chunk_size, args.phases, device,
                 on_round=publish)


def bench_calibrate(teacher, keep, pattern, args, device, report) -> None:
    arch = teacher.arch
    rows = args.calib_tokens // args.calib_seq
    mean_doc = getattr(args, "packed_docs", 0)
    if mean_doc:  # as the pipeline: one row per batch, with document boundaries
        calib = packed_batches(arch.vocab_size, rows, args.calib_seq, mean_doc, device)
    else:
        calib = random_batches(arch.vocab_size, 1, args.calib_seq, rows, device)
        calib = [{"input_ids": torch.cat([b["input_ids"] for b in calib[i:i + 4]])} for i in range(0, rows, 4)]
    strategy = get_strategy("taylor_calibrate")
    align = strategy.align if args.align_steps is None else replace(strategy.align, steps=args.align_steps)
    row = {"init": strategy.name, "tokens": rows * args.calib_seq, "seq": args.calib_seq,
           "docs": f"packed, mean {mean_doc}" if mean_doc else "none",
           "converted_layers": len(converted_layers(pattern)), "align_steps": align.steps}
    align_dtype = torch.bfloat16 if align.dtype == "bfloat16" else torch.float32

    def calibrate(steps: int):
        return calibrate_student(teacher, keep, strategy, calib_batches=calib, teacher_sha256=None,
                                 align=replace(align, steps=steps), progress=False, meta={"seq_len": args.calib_seq})

    try:
        row["warmup_s"] = warm_gdn_kernels(arch.with_pattern(pattern), converted_layers(pattern)[0], device,
                                           args.calib_seq, align_dtype)
        start = time.perf_counter()
        calibrate(min(align.steps, 2))  # every kernel at the timed run's shapes (compiled blocks included)
        sync(device)
        row["warmup_s"] += time.perf_counter() - start
        start = time.perf_counter()
        _, result = calibrate(align.steps)
        sync(device)
        row["wall_s"] = time.perf_counter() - start
        row.update(stats_s=result.get("stats_seconds"), align_s=result.get("align_seconds"),
                   goal=f"<= {CALIBRATE_GOAL_S:.0f} s", met=row["wall_s"] <= CALIBRATE_GOAL_S)
        best = [v["best"] for v in result.get("align", {}).values()]
        if best:
            row["mean_best_rel_mse"] = sum(best) / len(best)
    except Exception as exc:
        row["note"] = f"failed: {type(exc).__name__}"
        report.error("calibrate_student", exc)
    report.add("calibrate", row)
    if args.profile and "wall_s" in row:  # the same run, 10 alignment steps, with the host's waits counted
        steps = min(align.steps, 10)
        syncs = host_syncs(lambda: calibrate(steps), device)
        if syncs:
            report.add("syncs", {"what": f"calibrate_student ({steps} alignment steps)", **syncs})


def bench_teacher(args: Any, device: torch.device, report: Report) -> HybridLM:
    """SmolLM2 from --gguf, else random weights of the --preset shape (tiny with --quick)."""
    if args.gguf:
        teacher, _ = load_gguf_teacher(args.gguf)
        report.note(f"teacher weights from {args.gguf}")
        return teacher
    preset = "tiny" if args.quick else getattr(args, "preset", "smollm2-135m")
    if not args.quick:
        report.note(f"teacher: random weights of the {preset} shape")
    with torch.device(device):
        return HybridLM(PRESETS[preset]())


def run(args: Any) -> int:
    """Checks, the statistics pass against the forward and (unless args.no_calibrate) calibration."""
    device = pick_device(args.device)
    if getattr(args, "kernel_configs", False):
        return bench_kernel_configs(args, device)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    report = Report("stats", args.out, device, args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    teacher = bench_teacher(args, device, report).to(device=device, dtype=dtype).eval()
    pattern = quarter_pattern(teacher.arch.num_layers)
    keep = [i for i, kind in enumerate(pattern) if kind == "A"]
    layers = converted_layers(pattern)
    report.data["pattern"] = pattern
    if getattr(args, "calibrate_only", False):
        bench_calibrate(teacher, keep, pattern, args, device, report)
        return _finish(report)
    try:
        report.add("checks", stats_check(teacher, layers, device, {"teacher_sha256": "bench", "seq_len": 256},
                                         args.chunk_size))
    except Exception as exc:
        report.error("stats check", exc)
    if args.sweep1_reference and use_stats_kernel(torch.zeros(1, device=device)):
        try:
            report.add("checks", kernel_check(teacher, layers, device, {"teacher_sha256": "bench", "seq_len": 256},
                                              args.chunk_size))
        except Exception as exc:
            report.error("kernel check", exc)
    if getattr(args, "phases", 0):
        bench_phases_rows(teacher, layers, teacher.arch.with_pattern(pattern), args, device, report)
        return _finish(report)
    bench_stats(teacher, layers, teacher.arch.with_pattern(pattern), args, device, report)
    if not args.no_calibrate:
        bench_calibrate(teacher, keep, pattern, args, device, report)
    return _finish(report)


def bench_kernel_configs(args: Any, device: torch.device) -> int:
    """--kernel-configs: `stats_kernel.kernel_rows` for every --kernel-shapes entry."""
    from megatron_tc.bench.stats_kernel import kernel_rows, parse_shape

    shapes = [parse_shape(text) for text in args.kernel_shapes]  # every entry checked before any work
    if device.type != "cuda" or not use_stats_kernel(torch.zeros(1, device=device)):
        raise InputError("error: --kernel-configs times the Triton kernel: it needs CUDA and triton")
    report = Report("stats_kernel", args.out, device, args)
    for shape in shapes:
        for row in kernel_rows(shape, device, args.budget_ms):
            report.add("kernel", row)
    report.finish([("Sweep 1's kernel by launch configuration, beside flash attention (ms)", "kernel",
                    ["shape", "impl", "ms", "x_flash", "fastest", "note"])])
    return 0


def _finish(report: Report) -> int:
    report.finish([
        ("Check", "checks", ["check", "max_rel_err", "worst", "median_rel_err"]),
        ("Statistics pass vs teacher forward (same tokens)", "rows",
         ["pass", "impl", "tokens", "B", "T", "layers", "dtype", "ms", "tok_per_s", "ratio", "goal", "met", "note"]),
        ("Sweep profiles (self time; all operators, then the heaviest; then each phase's whole host time)",
         "profile", ["pass", "op", "range", "calls", "host_ms", "device_ms"]),
        ("Host waits for the device (one warm call, CUDA sync debug mode)", "syncs", ["what", "host_syncs", "where"]),
        ("Phases of the statistics pass (ms: median (min-max); ratio: median over the forward's)", "phases",
         ["pass", "ms", "ratio", "sweep 1 ms", "sweep 2 ms", "repeats"]),
        ("Calibration wall time (taylor_calibrate)", "calibrate",
         ["init", "tokens", "seq", "docs", "converted_layers", "align_steps", "warmup_s", "stats_s", "align_s", "wall_s",
          "mean_best_rel_mse", "goal", "met", "note"]),
    ])
    return 0
