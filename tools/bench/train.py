#!/usr/bin/env python
"""Stage-2 distillation step on one device: teacher forward (no grad) + student forward/backward
on the KL loss + optimizer step, bf16, GDN layers on fla's kernels; tokens/s and MFU.

    python tools/bench/train.py [--out FILE] [--quick] [--models smollm2-135m,llama-1b]
        [--batch 8 --seq 2048] [--steps 5] [--deepspeed] [--trainable all] [--profile]
        [--variants before,loss,after]

Plain torch (default): fp32 student weights under bf16 autocast, fused AdamW; the teacher in
bf16. --deepspeed: the student through `megatron_tc.parallel.deepspeed_engine` (ZeRO-3 on one
rank, bf16, fp32 master weights), as stage 2 runs it. The loss is `distill.losses.distill_loss`
(KL at temperature 1) on random token ids.

--variants times several versions of the same step in one run (one row each, same models and
trainer), so one call gives before and after:
  before  the whole-batch fp32 vocabulary losses (impl="reference") and the eager model blocks
          (MEGATRON_TC_COMPILE=0): the code of the first H200 run
  loss    the chunked vocabulary losses (`parallel.chunked_losses`, compiled per chunk), eager model
  after   chunked losses and the compiled model blocks (`model.fused`): what stage 2 runs now

Check before timing: one forward/backward at [1, 512] with the GDN layers on fla under bf16
autocast against the PyTorch chunked backend in fp32 (same weights, same teacher logits):
relative error of the loss and of all gradients together (global), next to the same errors of
the PyTorch chunked backend under the same autocast (the bf16 baseline: fla is right when its
global error is about the baseline's), plus per-tensor errors (median, worst; the worst is a
tiny-gradient tensor, dt_bias / b_proj.bias, whose per-token terms cancel).

MFU = model FLOPs per step / step time / measured bf16 matmul rate (8192^3 bf16 product, this
run). Model FLOPs (megatron_tc/bench/models.py): student 3 x forward (trainable=all; else
2 x forward + 2 N_trainable per token) + teacher 1 x forward, forward = 2 N per token + causal
attention 4 H D (T+1)/2 per token and layer + GDN chunk terms; embeddings excluded; the recompute
of --activation-checkpointing is not counted.

Memory (CUDA): the allocator's peak (allocated and reserved) over the timed steps; one more step
with the peak of forward + backward and of the optimizer step read apart; the bytes one layer of
each kind keeps for backward (`bench.activation_memory`) against the memory plan's per-layer term;
for --deepspeed runs the plan (`tools/plan.py`) of the same step next to the measured peak.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.bench.activation_memory import PhasePeaks, layer_saved_bytes  # noqa: E402
from megatron_tc.bench.common import Report, measure_peaks, model_names, parse_args, pick_device, rel_err, sync, time_once  # noqa: E402
from megatron_tc.bench.models import PRESETS, quarter_pattern  # noqa: E402
from megatron_tc.bench.train_step import Trainer, deepspeed_context, step_flops  # noqa: E402
from megatron_tc.distill.losses import LossWeights, distill_loss  # noqa: E402
from megatron_tc.distill.stage2 import select_trainable  # noqa: E402
from megatron_tc.model import HybridLM  # noqa: E402


VARIANTS = {"before": ("reference", "0"), "loss": ("chunked", "0"), "after": ("chunked", "1")}  # (loss, MEGATRON_TC_COMPILE)


def _grad_errors(test: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Errors of gradient set `test` against `ref` ({name: grad}).

    global: ||test - ref|| / ||ref|| over all parameters together (the number that says whether
    the update direction is right); per tensor: ||test_n - ref_n|| / ||ref_n||, whose maximum is
    dominated by tiny-gradient tensors (dt_bias, A_log, b_proj.bias: sums over tokens that cancel
    10-50x), so the worst tensor is also given relative to the global norm."""
    ref_norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in ref.values()))
    diffs = {n: float((test[n].double() - g.double()).norm()) for n, g in ref.items()}
    errs = {n: diffs[n] / float(g.double().norm()) for n, g in ref.items() if g.norm() > 0}
    worst = max(errs, key=errs.get)
    return {"grad_rel_err_global": math.sqrt(sum(d * d for d in diffs.values())) / ref_norm,
            "max_grad_rel_err": errs[worst], "worst_param": worst,
            "worst_param_err_vs_global_norm": diffs[worst] / ref_norm,
            "median_grad_rel_err": sorted(errs.values())[len(errs) // 2]}


def gradient_check(student: HybridLM, teacher: HybridLM, device, seq: int) -> dict:
    """fla + bf16 autocast vs the PyTorch chunked backend in fp32: loss and gradients.

    On CUDA also the PyTorch chunked backend under the same bf16 autocast ("bf16 baseline"): at
    random init bf16 alone moves every gradient by tens of percent (the loss gradient at the final
    norm is ~99% parallel to the hidden state, and RMSNorm's backward keeps only the rest), so the
    kernel is judged by fla's global error against that baseline's, not by a per-tensor maximum."""
    ids = torch.randint(0, student.arch.vocab_size, (1, seq), device=device)
    with torch.no_grad():
        t_logits = teacher(ids)
    amp = device.type == "cuda"
    runs = [("ref", "chunk", False, "reference"), ("test", "auto", amp, "reference")]
    runs += [("bf16_chunk", "chunk", True, "reference")] if amp else []
    runs += [("chunked_loss", "auto", amp, "chunked")]  # same as "test" but the chunked losses
    runs += [("eager_model", "auto", amp, "chunked")]  # same as "chunked_loss" with MEGATRON_TC_COMPILE=0
    results = {}
    for label, backend, use_amp, impl in runs:
        if label == "eager_model":
            os.environ["MEGATRON_TC_COMPILE"] = "0"
        student.set_gdn_backend(backend)
        student.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else nullcontext()
        with ctx:
            logits = student(ids)
        loss, _ = distill_loss(logits, t_logits, ids, student.arch.vocab_size, LossWeights(), impl=impl)
        loss.backward()
        results[label] = (loss.detach(), {n: p.grad.detach().clone() for n, p in student.named_parameters() if p.grad is not None})
        os.environ.pop("MEGATRON_TC_COMPILE", None)
    student.set_gdn_backend("auto")
    student.zero_grad(set_to_none=True)
    ref_loss, ref_grads = results["ref"]
    test_loss, test_grads = results["test"]
    out = {"loss_ref": float(ref_loss), "loss_rel_err": rel_err(test_loss, ref_loss), **_grad_errors(test_grads, ref_grads)}
    chunked_loss, chunked_grads = results["chunked_loss"]  # chunked vs reference losses, same model run
    out.update(chunked_vs_reference_loss_rel_err=rel_err(chunked_loss, test_loss),
               chunked_vs_reference_grad_rel_err_global=_grad_errors(chunked_grads, test_grads)["grad_rel_err_global"])
    eager_loss, eager_grads = results["eager_model"]  # compiled model blocks vs eager, same losses
    out.update(compiled_vs_eager_loss_rel_err=rel_err(chunked_loss, eager_loss),
               compiled_vs_eager_grad_rel_err_global=_grad_errors(chunked_grads, eager_grads)["grad_rel_err_global"])
    if "bf16_chunk" in results:
        base = _grad_errors(results["bf16_chunk"][1], ref_grads)
        out.update(bf16_chunk_grad_rel_err_global=base["grad_rel_err_global"],
                   bf16_chunk_median_grad_rel_err=base["median_grad_rel_err"],
                   bf16_chunk_max_grad_rel_err=base["max_grad_rel_err"],
                   global_err_vs_bf16_chunk=out["grad_rel_err_global"] / max(base["grad_rel_err_global"], 1e-30))
    return out


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
                   tflops=flops["flops"] / (ms * 1e-3) / 1e12, mfu=flops["flops"] / (ms * 1e-3) / (peaks["matmul_tflops"] * 1e12),
                   loss_first=losses[0], loss_last=losses[-1], finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
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
        out.update(plan_GiB=plan["total_gib"], plan_parts_GiB={k: round(v / 2**30, 2) for k, v in plan["bytes"].items()},
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
    base = {"model": name, "mode": "deepspeed-zero3" if ctx is not None else "torch-amp", "B": args.batch, "T": args.seq,
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
            time_steps(trainer, make_ids, dict(base, variant=variant, loss_impl=impl, compiled_model=compile_model == "1"),
                       flops, args, device, peaks, report)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"presets: {', '.join(PRESETS)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compilation)")
    p.add_argument("--trainable", default="all", choices=("all", "mixers", "gdn"))
    p.add_argument("--deepspeed", action="store_true", help="student under DeepSpeed ZeRO-3 (one rank)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute every student layer in backward")
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON instead of configs/deepspeed/zero3.json ('auto' values filled as in stage 2)")
    p.add_argument("--profile", action="store_true", help="torch.profiler over 2 more steps: top kernels")
    p.add_argument("--check-t", type=int, default=512, help="tokens of the gradient check (0: no check)")
    p.add_argument("--variants", default="before,loss,after",
                   help=f"comma list of {', '.join(VARIANTS)} (see the module docstring); a row each")
    args = parse_args(p, argv, dict(models="tiny", batch=2, seq=64, steps=2, warmup=1, check_t=48))
    names = model_names(args.models, PRESETS)
    args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    unknown = [x for x in args.variants if x not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants {unknown or args.variants}: use a comma list of {', '.join(VARIANTS)}")
    device = pick_device(args.device)
    torch.manual_seed(0)
    report = Report("train", args.out, device, args)
    peaks = measure_peaks(device, quick=args.quick)
    report.data["peaks"] = peaks
    report.note(f"measured peak: {peaks['matmul_tflops']:.1f} TFLOP/s ({peaks['matmul_dtype']} {peaks['matmul_size']}^3 matmul), "
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
        ("Distillation step", "rows", ["model", "mode", "variant", "loss_impl", "compiled_model", "B", "T", "trainable", "step_ms", "tok_per_s", "tflops", "mfu",
                                       "flops", "peak_mem_GiB", "peak_reserved_GiB", "static_GiB", "fwd_bwd_peak_GiB",
                                       "step_peak_GiB", "busy_ms", "first_step_ms", "finite", "note"]),
        ("Memory: plan against measured (GiB; layer bytes per token)", "memory",
         ["model", "variant", "plan_GiB", "measured_peak_GiB", "plan_error", "layer_A_plan_B_per_token",
          "layer_A_measured_B_per_token", "layer_G_plan_B_per_token", "layer_G_measured_B_per_token"]),
        ("Profile: top kernels per step", "profile", ["model", "variant", "kernel", "calls", "ms_per_step", "share"]),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
