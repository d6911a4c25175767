"""One rank of the data-parallel scaling benchmark (tools/bench/scaling.py --worker, started by
torchrun): the stage-2 step of `bench.train_step` under DeepSpeed ZeRO-3 on its own random
micro-batch, timed between a device sync and a barrier on every rank; rank 0 writes the result."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_tc.bench.models import PRESETS

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _sync_barrier(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _all_reduce(value: float, op: str, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return float(t.item())


def _peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def run_worker(args) -> None:
    """One rank of an N-rank job (environment from torchrun). Rank 0 writes args.result (JSON)."""
    import torch.distributed as dist

    from megatron_tc.bench import train_step
    from megatron_tc.bench.common import measure_peaks
    from megatron_tc.bench.models import quarter_pattern
    from megatron_tc.distill.stage2 import select_trainable
    from megatron_tc.model import HybridLM
    from megatron_tc.parallel.deepspeed_engine import release_engine
    from megatron_tc.parallel.state import init_parallel, shutdown_distributed

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if not cuda:
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("WORLD_SIZE", "1"))  # DeepSpeed's CPU accelerator
    ctx = init_parallel(1, 1)  # nccl on CUDA (sets the device from LOCAL_RANK), gloo otherwise
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    peaks = measure_peaks(device, quick=args.quick)
    arch = PRESETS[args.model]()
    torch.manual_seed(0)  # the same initial weights on every rank
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(device):
        teacher = HybridLM(arch)
        student = HybridLM(arch.with_pattern(quarter_pattern(arch.num_layers)))
    teacher = teacher.to(dtype).eval().requires_grad_(False)
    select_trainable(student, args.trainable)
    t_build = time.perf_counter()
    trainer = train_step.Trainer(student, teacher, args, device, ctx)
    t_setup = time.perf_counter() - t_build
    gen = torch.Generator(device=device).manual_seed(1000 + ctx.rank)  # each rank its own data
    def make_ids() -> torch.Tensor:
        return torch.randint(0, arch.vocab_size, (args.batch, args.seq), device=device, generator=gen)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    _sync_barrier(device)
    t0 = time.perf_counter()
    for _ in range(args.warmup):  # fla compiles/autotunes here
        trainer.step(make_ids())
    _sync_barrier(device)
    first_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(args.steps):
        ids = make_ids()
        _sync_barrier(device)
        start = time.perf_counter()
        losses.append(float(trainer.step(ids)))
        _sync_barrier(device)
        times.append((time.perf_counter() - start) * 1e3)
    # every rank saw the same barriers, so the times agree up to the barrier's latency; take the max
    step_ms = _all_reduce(statistics.median(times), "max", device)
    peak = _all_reduce(_peak_mem_gib(device), "max", device)
    finite = _all_reduce(float(all(x == x and abs(x) != float("inf") for x in losses)), "min", device) == 1.0
    n = ctx.world_size
    flops = train_step.step_flops(student.arch, arch, args.trainable, args.batch, args.seq)["flops"] * n
    tokens = n * args.batch * args.seq
    if ctx.rank == 0:
        result = {"N": n, "dp": ctx.dp_size, "model": args.model, "B": args.batch, "T": args.seq,
                  "zero_optimization": trainer.ds_config["zero_optimization"],
                  "trainable": args.trainable, "step_ms": step_ms, "step_ms_all": times,
                  "tok_per_s": tokens / (step_ms * 1e-3), "tok_per_s_per_gpu": tokens / n / (step_ms * 1e-3),
                  "flops_per_step": flops, "tflops": flops / (step_ms * 1e-3) / 1e12,
                  "mfu": flops / (step_ms * 1e-3) / (n * peaks["matmul_tflops"] * 1e12),
                  "matmul_tflops_1gpu": peaks["matmul_tflops"], "peak_mem_GiB": peak, "first_step_s": first_s,
                  "engine_setup_s": t_setup, "loss_first": losses[0], "loss_last": losses[-1], "finite": finite,
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu", "backend": dist.get_backend(),
                  "multicast_off": all(os.environ.get(k) == v for k, v in MULTICAST_OFF.items())}
        path = Path(args.result)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)
        print(f"N={n}: {step_ms:.1f} ms/step, {result['tok_per_s']:.0f} tok/s, MFU {result['mfu']:.3f}, "
              f"peak {peak:.2f} GiB", flush=True)
    _sync_barrier(device)
    # DeepSpeed keeps ZeRO-3 engines alive past their use (see release_engine), and their groups torn
    # down during interpreter finalization have aborted a rank (SIGABRT): release them here.
    release_engine(trainer.engine)  # a no-op when the trainer has no engine (engine None)
    del trainer
    shutdown_distributed()
