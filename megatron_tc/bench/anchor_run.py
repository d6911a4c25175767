"""The stage-2 anchor benchmark (tools/bench/train_anchor.py): the pipeline's step
(`Stage2Trainer.train_step`) against a plain PyTorch distillation loop on the same weights and
batches, in one process per rank; first losses, interleaved timed rounds, an optional profile."""
from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_tc.bench.anchor import (REGIONS, PlainLoop, SyntheticBatches, clock_pipeline, interleaved_runs,
                                      pipeline_config, pipeline_trainer, region_ms, result_rows, step_flops)
from megatron_tc.bench.common import Report, measure_peaks, model_names, profile_rows, rel_err
from megatron_tc.bench.models import PRESETS, quarter_pattern
from megatron_tc.model import HybridLM


def parallel_context():
    """torch.distributed over the launcher's ranks (one process when started plainly)."""
    from megatron_tc.testing import free_port

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from megatron_tc.parallel.state import init_parallel

    return init_parallel(1, 1)


def summed_peak(peaks: dict, ctx) -> float:
    """TFLOP/s of the matmul peak over all ranks (each rank measured its own share of the cores)."""
    from megatron_tc.parallel.comm import all_reduce_

    value = torch.tensor([peaks["matmul_tflops"]], dtype=torch.float64)
    if ctx.world_size > 1:
        all_reduce_(value)
    return float(value)


def dp_mean(value: torch.Tensor, ctx) -> float:
    """The mean of a per-rank scalar over the data-parallel ranks (the pipeline logs that mean)."""
    from megatron_tc.parallel.comm import all_reduce_

    value = value.detach().double().cpu().reshape(1)
    if ctx.dp_size > 1:
        all_reduce_(value, group=ctx.dp_group)
    return float(value) / ctx.dp_size


def bench_model(name: str, args, device: torch.device, peak_tflops: float, ctx, report: Report, workdir: str) -> None:
    arch = PRESETS[name]()
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        teacher = HybridLM(arch)
        student = HybridLM(arch.with_pattern(quarter_pattern(arch.num_layers)))
    teacher = teacher.to(torch.bfloat16 if cuda else torch.float32).eval().requires_grad_(False)
    dp = ctx.dp_size
    cfg = pipeline_config([f"data.seq_len={args.seq}", f"data.micro_batch_size={args.batch}",
                           f"data.global_batch_size={args.batch * args.micro_steps * dp}",
                           f"run.precision={'bf16' if cuda else 'fp32'}", "distill.stage2.steps=1000000",
                           "distill.stage2.warmup_steps=0", f"parallel.zero_stage={args.zero_stage}"])
    batches = lambda: SyntheticBatches(arch.vocab_size, args.seq, args.batch, args.micro_steps,  # noqa: E731
                                       ctx.dp_rank, dp, seed=1, device=device)
    loader = batches()
    trainer, state, guard = pipeline_trainer(cfg, ctx, student, teacher, loader, device, Path(workdir))
    plain_batches = batches()
    plain = PlainLoop(student, teacher, device, cfg.distill.stage2.lr, ctx)
    del student

    def pipeline_step():
        out = trainer.train_step(state, guard)
        state.step += 1
        return out

    def plain_step():
        return plain.train_step(plain_batches.next_step())

    first = {"pipeline": pipeline_step()["loss"], "plain": dp_mean(plain_step(), ctx)}
    if ctx.rank == 0:
        report.add("checks", {"model": name, "pipeline_first_loss": first["pipeline"],
                              "plain_first_loss": first["plain"],
                              "rel_diff": rel_err(torch.tensor(first["pipeline"]), torch.tensor(first["plain"]))})
    seconds = interleaved_runs({"pipeline": pipeline_step, "plain": plain_step}, device, args.runs, args.steps,
                               args.warmup)
    if args.profile:  # after the timed rounds: one more step of each under the profiler
        for path, step in (("pipeline", pipeline_step), ("plain", plain_step)):
            for row in profile_rows(step, device):
                if ctx.rank == 0:
                    report.add("profile", {"model": name, "path": path, **row})

        def pipeline_clocked(clock):
            remove = clock_pipeline(trainer, clock)
            try:
                pipeline_step()
            finally:
                remove()

        for path, step in (("pipeline", pipeline_clocked),
                           ("plain", lambda clock: plain.train_step(plain_batches.next_step(), clock))):
            ms = region_ms(step, device)
            if ctx.rank == 0:
                report.add("regions", {"model": name, "path": path, **{f"{k}_ms": v for k, v in ms.items()},
                                       "sum_ms": sum(ms.values())})
    flops = step_flops(trainer.engine.module.arch, arch, loader.tokens_per_step, args.seq)["flops"]
    base = {"model": name, "ranks": ctx.world_size, "B": args.batch, "T": args.seq, "micro_steps": args.micro_steps,
            "runs": args.runs, "steps_per_run": args.steps, "flops_per_step": flops}
    if cuda:
        base["peak_mem_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    compiled = {(True, True): ", compiled student and teacher layers", (True, False): ", compiled layers",
                (False, True): ", compiled teacher layers", (False, False): ""}[trainer.compiled, trainer.teacher_compiled]
    labels = {"pipeline": f"pipeline (ZeRO-{trainer.engine.zero_optimization_stage()}{compiled})",
              "plain": "plain torch"}
    for row in result_rows(seconds, labels, loader.tokens_per_step, flops, peak_tflops):
        if ctx.rank == 0:
            report.add("rows", {**base, **row})
            print(f"{name} {row['path']}: {row['step_ms_median']:.1f} ms/step, {row['tok_per_s_median']:.0f} tok/s, "
                  f"MFU {row['mfu_median']:.3f}", flush=True)
    trainer.close()
    del trainer, plain, teacher
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()



def run(args: Any) -> int:
    """Every model of args.models on this process's rank; rank 0 writes the report."""
    names = model_names(args.models, PRESETS)
    ctx = parallel_context()
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    report = Report("train_anchor", args.out, device, args)
    peaks = measure_peaks(device, quick=args.quick)
    peak = summed_peak(peaks, ctx)
    report.data["peaks"] = dict(peaks, matmul_tflops_all_ranks=peak, ranks=ctx.world_size)
    with tempfile.TemporaryDirectory(prefix="train_anchor.") as workdir:
        for name in names:
            bench_model(name, args, device, peak, ctx, report, workdir)
    if ctx.rank == 0:
        spreads = lambda key: [f"{key}_{k}" for k in ("min", "median", "max")]  # noqa: E731
        report.finish([
            ("First step: same weights, same batch", "checks",
             ["model", "pipeline_first_loss", "plain_first_loss", "rel_diff"]),
            ("Distillation step", "rows", ["model", "path", "ranks", "B", "T", "micro_steps", "tokens_per_step",
                                           *spreads("step_ms"), *spreads("tok_per_s"), *spreads("mfu"),
                                           *spreads("vs_plain"), "peak_mem_GiB"]),
            ("Regions of a step (device drained at each boundary; median of 3 steps)", "regions",
             ["model", "path", *[f"{k}_ms" for k in REGIONS], "sum_ms"]),
            ("Profile of one step (self time; all operators, then the heaviest)", "profile",
             ["model", "path", "op", "calls", "host_ms", "device_ms"]),
        ])
    from megatron_tc.parallel.state import shutdown_distributed

    shutdown_distributed()
    return 0
