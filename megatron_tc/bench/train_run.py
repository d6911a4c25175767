"""The distillation step benchmark (tools/bench/train.py): teacher forward + student
forward/backward on the KL loss + optimizer step on one device, timed per variant of the step
(vocabulary losses, compiled model blocks); tokens/s, MFU, memory against the memory plan."""
from __future__ import annotations

import gc
import os
from typing import Any

import torch

from megatron_tc.bench.activation_memory import PhasePeaks, layer_saved_bytes
from megatron_tc.bench.common import Report, measure_peaks, model_names, pick_device, sync, time_once
from megatron_tc.bench.models import PRESETS, quarter_pattern
from megatron_tc.bench.train_check import gradient_check
from megatron_tc.bench.train_step import Trainer, deepspeed_context, step_flops
from megatron_tc.distill.stage2 import select_trainable
from megatron_tc.model import HybridLM

# variant -> (distill_loss impl, $MEGATRON_TC_COMPILE)
VARIANTS = {"reference": ("reference", "0"), "chunked-loss": ("chunked", "0"), "fused": ("chunked", "1")}


def profile_steps(trainer: Trainer, make_ids, device, rows: int = 20) -> tuple[str, list[dict], float]:
    """Two steps under torch.profiler. Returns (torch's table, the top `rows` kernels (CUDA) or
    ops (CPU) by self time per step, kernel time per step in ms: GPU busy time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            trainer.step(make_ids())
        sync(device)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows,
                           max_name_column_width=70)
    if cuda:  # kernels only: an op's self device time is its kernels' time, counted again
        events, attr = [e for e in averages if e.device_type == DeviceType.CUDA], "self_device_time_total"
    else:
        events, attr = list(averages), "self_cpu_time_total"
    busy = sum(getattr(e, attr) for e in events) / 1e3 / 2
    top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:rows]
    out = [{"kernel": e.key[:90], "calls": e.count // 2, "ms_per_step": getattr(e, attr) / 1e3 / 2,
            "share": getattr(e, attr) / 1e3 / 2 / max(busy, 1e-9)} for e in top]
    return table, out, busy


def time_steps(trainer: Trainer, make_ids, row: dict, flops: dict, args, device, peaks, report: Report) -> None:
    """Warm-up steps, then the median of args.steps timed steps (and the profile) -> one row."""
    name, impl = row["model"], row["variant"]
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        warm = [time_once(lambda: trainer.step(make_ids()), device) for _ in range(args.warmup)]
        times, losses = [], []
        for _ in range(args.steps):
            ids = make_ids()
            holder = {}
            times.append(time_once(lambda: holder.setdefault("loss", trainer.step(ids)), device))
            losses.append(float(holder["loss"]))
        times.sort()
        ms = times[len(times) // 2]
        row.update(step_ms=ms, first_step_ms=warm[0] if warm else None, tok_per_s=args.batch * args.seq / (ms * 1e-3),
                   tflops=flops["flops"] / (ms * 1e-3) / 1e12,
                   mfu=flops["flops"] / (ms * 1e-3) / (peaks["matmul_tflops"] * 1e12),
                   loss_first=losses[0], loss_last=losses[-1],
                   finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
                   **{k: v / 1e12 for k, v in flops.items()})
        if device.type == "cuda":
            row["peak_mem_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["peak_reserved_GiB"] = torch.cuda.max_memory_reserved(device) / 2**30
        phases = PhasePeaks(device)
        trainer.step(make_ids(), phases)  # one more step, its peaks read per phase
        row.update(phases.as_gib())
        print(f"{name} ({impl}): {ms:.1f} ms/step, {row['tok_per_s']:.0f} tok/s, MFU {row['mfu']:.3f}", flush=True)
    except Exception as exc:
        row["note"] = f"failed: {type(exc).__name__}"
        report.error(f"{name} train step ({impl})", exc)
    report.add("rows", row)
    if args.profile and "step_ms" in row:
        try:
            table, top, busy = profile_steps(trainer, make_ids, device)
            print(f"profile {name}, {impl} (2 steps):\n{table}", flush=True)
            row["busy_ms"] = busy  # kernel time per step (CUDA) / op time (CPU); step_ms - busy_ms: idle
            report.save()
            for entry in top:
                report.add("profile", {"model": name, "variant": impl, **entry})
        except Exception as exc:
            report.error(f"{name} profile ({impl})", exc)


def memory_check(arch, student_arch, args, device, report: Report) -> None:
    """The memory plan of the last timed row against its measured peaks (DeepSpeed runs), and the
    bytes per token one layer of each kind keeps for backward against the plan's per-layer term."""
    from megatron_tc.parallel.memory_plan import PlanInput, layer_activation_bytes, plan_memory

    row = report.data["rows"][-1]
    out = {"model": row["model"], "variant": row["variant"], "measured_peak_GiB": row.get("peak_mem_GiB")}
    if row["mode"].startswith("deepspeed"):
        plan = plan_memory(PlanInput(arch, student_arch.layer_pattern, micro_batch_size=args.batch, seq_len=args.seq,
                                     activation_checkpointing=args.activation_checkpointing, trainable=args.trainable))
        out.update(plan_GiB=plan["total_gib"],
                   plan_parts_GiB={k: round(v / 2**30, 2) for k, v in plan["bytes"].items()},
                   **{f"plan_{k}": v for k, v in plan.items() if k.endswith("_phase_gib")})
        if out["measured_peak_GiB"]:
            out["plan_error"] = plan["total_gib"] / out["measured_peak_GiB"] - 1
    for kind in sorted(set(student_arch.layer_kinds)):
        out[f"layer_{kind}_measured_B_per_token"] = layer_saved_bytes(student_arch, kind, args.batch, args.seq, device)
        out[f"layer_{kind}_plan_B_per_token"] = layer_activation_bytes(student_arch, kind)
    report.add("memory", out)


def bench_model(name: str, args, device, peaks, report: Report, ctx) -> None:
    arch = PRESETS[name]()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        teacher = HybridLM(arch)
        student = HybridLM(arch.with_pattern(quarter_pattern(arch.num_layers)))
    teacher = teacher.to(dtype).eval().requires_grad_(False)
    select_trainable(student, args.trainable)
    student.set_activation_checkpointing(args.activation_checkpointing)
    base = {"model": name, "mode": "deepspeed-zero3" if ctx is not None else "torch-amp",
            "B": args.batch, "T": args.seq,
            "trainable": args.trainable, "student_params_M": sum(p.numel() for p in student.parameters()) / 1e6,
            "activation_checkpointing": args.activation_checkpointing}
    try:
        if args.check_t > 0:
            report.add("checks", {"model": name, **gradient_check(student, teacher, device, args.check_t)})
    except Exception as exc:
        report.error(f"{name} gradient check", exc)
    try:
        trainer = Trainer(student, teacher, args, device, ctx)
    except Exception as exc:
        report.error(f"{name} {base['mode']} set-up", exc)
        return
    make_ids = lambda: torch.randint(0, arch.vocab_size, (args.batch, args.seq), device=device)  # noqa: E731
    flops = step_flops(student.arch, arch, args.trainable, args.batch, args.seq)
    for variant in args.variants:  # one trainer (one engine): only the loss and the model blocks change
        impl, compile_model = VARIANTS[variant]
        trainer.loss_impl = impl
        os.environ["MEGATRON_TC_COMPILE"] = compile_model
        try:
            row = dict(base, variant=variant, loss_impl=impl, compiled_model=compile_model == "1")
            time_steps(trainer, make_ids, row, flops, args, device, peaks, report)
        finally:
            os.environ.pop("MEGATRON_TC_COMPILE", None)
    try:
        memory_check(arch, student.arch, args, device, report)
    except Exception as exc:
        report.error(f"{name} memory check", exc)
    del trainer, student, teacher
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()



def parse_variants(text: str) -> list[str]:
    """"reference,fused" -> ["reference", "fused"]; ValueError naming the known variants otherwise."""
    variants = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in variants if x not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants {unknown or variants}: use a comma list of {', '.join(VARIANTS)}")
    return variants


def run(args: Any) -> int:
    """Every model of args.models, every variant of args.variants (a list); the report written."""
    names = model_names(args.models, PRESETS)
    device = pick_device(args.device)
    torch.manual_seed(0)
    report = Report("train", args.out, device, args)
    peaks = measure_peaks(device, quick=args.quick)
    report.data["peaks"] = peaks
    report.note(f"measured peak: {peaks['matmul_tflops']:.1f} TFLOP/s "
                f"({peaks['matmul_dtype']} {peaks['matmul_size']}^3 matmul), "
                f"copy {peaks['copy_gbps']:.0f} GB/s")
    ctx = None
    if args.deepspeed:
        try:
            ctx = deepspeed_context()
        except Exception as exc:
            report.error("deepspeed set-up (falling back to plain torch)", exc)
    for name in names:
        bench_model(name, args, device, peaks, report, ctx)
    report.finish([
        ("Check: fla + bf16 autocast vs PyTorch chunked fp32 (one fwd/bwd)", "checks",
         ["model", "loss_ref", "loss_rel_err", "grad_rel_err_global", "bf16_chunk_grad_rel_err_global",
          "global_err_vs_bf16_chunk", "median_grad_rel_err", "max_grad_rel_err", "worst_param",
          "worst_param_err_vs_global_norm", "chunked_vs_reference_loss_rel_err",
          "chunked_vs_reference_grad_rel_err_global", "compiled_vs_eager_loss_rel_err",
          "compiled_vs_eager_grad_rel_err_global"]),
        ("Distillation step", "rows", ["model", "mode", "variant", "loss_impl", "compiled_model", "B", "T", "trainable",
                                       "step_ms", "tok_per_s", "tflops", "mfu",
                                       "flops", "peak_mem_GiB", "peak_reserved_GiB", "static_GiB", "fwd_bwd_peak_GiB",
                                       "step_peak_GiB", "busy_ms", "first_step_ms", "finite", "note"]),
        ("Memory: plan against measured (GiB; layer bytes per token)", "memory",
         ["model", "variant", "plan_GiB", "measured_peak_GiB", "plan_error", "layer_A_plan_B_per_token",
          "layer_A_measured_B_per_token", "layer_G_plan_B_per_token", "layer_G_measured_B_per_token"]),
        ("Profile: top kernels per step", "profile", ["model", "variant", "kernel", "calls", "ms_per_step", "share"]),
    ])
    return 0
