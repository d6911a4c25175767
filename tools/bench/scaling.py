#!/usr/bin/env python
"""Data-parallel scaling of the stage-2 distillation step under DeepSpeed ZeRO-3: tokens/s at
N = 1, 2, 4, ... ranks (one GPU each), and the scaling efficiency tok/s(N) / (N * tok/s(1)).

    python tools/bench/scaling.py [--out FILE] [--quick] [--model llama-1b] [--ranks 1,2,4]
        [--batch 8 --seq 2048] [--steps 6] [--warmup 2] [--timeout 300]

The driver starts one torchrun job per N, one after the other (`python -m torch.distributed.run
--standalone --nproc_per_node N tools/bench/scaling.py --worker ...`), with NVLink multicast off in
the children's environment. Every rank runs the step of tools/bench/train.py --deepspeed (teacher
forward without grad + student forward/backward on the KL loss + ZeRO-3 optimizer step, bf16, GDN
layers on fla's kernels) on its own random micro-batch [batch, seq] (same shape on every rank, a
different seed per rank). Timed steps are bracketed by a device sync and a barrier on every rank,
so each step's time is the slowest rank's; the median over the timed steps is reported.

Reported per N: step_ms, global tokens/s = N * batch * seq / step time, tokens/s per GPU,
efficiency, the largest peak memory over ranks, MFU = model FLOPs of all ranks / step time /
(N x the measured bf16 matmul rate of one GPU; FLOPs as in tools/bench/train.py). Per-N logs go
to <out stem>_logs/ranks<N>.log. --quick: the tiny preset on CPU with gloo, N = 1, 2 (seconds,
checks the driver end to end). The default ranks are 1, 2, 4, ... up to the visible GPUs (and the
GPU count itself); on CPU up to --max-ranks (2).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parents[1]))
sys.path.insert(0, str(TOOLS))

from megatron_tc.bench.common import Report, parse_args  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLUMNS = ["N", "model", "B", "T", "step_ms", "tok_per_s", "tok_per_s_per_gpu", "efficiency", "mfu", "tflops",
           "peak_mem_GiB", "first_step_s", "wall_s", "finite", "note"]


# ---- one rank -----------------------------------------------------------------------------------
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

    import train as bench_train
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
    trainer = bench_train.Trainer(student, teacher, args, device, ctx)
    t_setup = time.perf_counter() - t_build
    gen = torch.Generator(device=device).manual_seed(1000 + ctx.rank)  # each rank its own data
    make_ids = lambda: torch.randint(0, arch.vocab_size, (args.batch, args.seq), device=device, generator=gen)  # noqa: E731

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
    flops = bench_train.step_flops(student.arch, arch, args.trainable, args.batch, args.seq)["flops"] * n
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


# ---- the driver -----------------------------------------------------------------------------------
def rank_counts(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`, and `limit` itself: rank_counts(6) == [1, 2, 4, 6]."""
    counts, n = [], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    if limit >= 1 and counts[-1] != limit:
        counts.append(limit)
    return counts


def child_env(n: int, cuda: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MULTICAST_OFF, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    root = str(TOOLS.parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cuda:
        env.setdefault("OMP_NUM_THREADS", "4")
    else:  # gloo ranks share the cores; more threads than cores per rank only thrash
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        env["LOCAL_SIZE"] = str(n)
    return env


def worker_argv(args, result: Path) -> list[str]:
    out = [str(Path(__file__).resolve()), "--worker", "--result", str(result), "--model", args.model,
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--trainable", args.trainable, "--device", args.device]
    if args.deepspeed_config:
        out += ["--deepspeed-config", str(Path(args.deepspeed_config).resolve())]
    return out + (["--quick"] if args.quick else [])


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group (it and every rank), SIGKILL after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _terminated(signum, frame):  # noqa: ARG001
    raise SystemExit(f"terminated by signal {signum}")


def run_one(n: int, args, logs: Path, cuda: bool) -> dict:
    """Start the N-rank job; its rank 0's result, or a row with a note on failure/timeout."""
    result = logs / f"ranks{n}.json"
    result.unlink(missing_ok=True)
    log = logs / f"ranks{n}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           *worker_argv(args, result)]
    print(f"=== N={n}: {' '.join(cmd)}  (log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        # own process group, so a timeout ends torchrun and every rank it started
        proc = subprocess.Popen(cmd, env=child_env(n, cuda), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(TOOLS.parents[1]))
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            rc = "timeout"
        except BaseException:  # SIGTERM of an outer `timeout` (see main), Ctrl-C: no orphaned ranks
            _end_group(proc)
            raise
    wall = time.perf_counter() - start
    if rc == 0 and result.exists():
        row = json.loads(result.read_text())
        row["wall_s"] = wall
        return row
    tail = log.read_text(errors="replace").splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return {"N": n, "model": args.model, "B": args.batch, "T": args.seq, "wall_s": wall,
            "note": f"failed: rc={rc} after {wall:.0f}s (log {log.name})"}


def add_efficiency(rows: list[dict]) -> None:
    """efficiency = tok/s(N) / (N * tok/s(1)), where N = 1 was measured."""
    base = next((r.get("tok_per_s") for r in rows if r["N"] == 1 and r.get("tok_per_s")), None)
    for r in rows:
        if base and r.get("tok_per_s"):
            r["efficiency"] = r["tok_per_s"] / (r["N"] * base)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="result JSON (default runs/bench/bench_scaling.json)")
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU, gloo, N = 1, 2")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--model", default="llama-1b", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--ranks", default=None, help="comma list of N (default 1, 2, 4, ... up to the GPUs)")
    p.add_argument("--max-ranks", type=int, default=2, help="on CPU: the largest N of the default list")
    p.add_argument("--batch", type=int, default=8, help="micro-batch rows per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="timed steps per N (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (fla compiles during the first; one warm-up step is too few)")
    p.add_argument("--trainable", default="all", choices=("all", "mixers", "gdn"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per N before the job is killed")
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON instead of configs/deepspeed/zero3.json (what stage 2 starts from)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parse_args(p, argv, dict(model="tiny", batch=2, seq=64, steps=3, warmup=1, device="cpu", timeout=120.0))
    if args.model not in PRESETS:
        raise SystemExit(f"error: unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")
    if args.worker:
        run_worker(args)
        return 0
    cuda = args.device != "cpu" and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise SystemExit("error: --device cuda asked for but torch.cuda.is_available() is False")
    if args.ranks:
        counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    else:
        counts = rank_counts(torch.cuda.device_count() if cuda else args.max_ranks)
    if cuda and max(counts) > torch.cuda.device_count():
        raise SystemExit(f"error: --ranks {args.ranks} asks for {max(counts)} GPUs; {torch.cuda.device_count()} visible")
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` around the driver ends the ranks too
    report = Report("scaling", args.out, torch.device("cpu"), args)
    report.data["env"]["device"] = "cuda" if cuda else "cpu"
    report.save()
    logs = report.path.with_name(report.path.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    for n in counts:
        row = run_one(n, args, logs, cuda)
        if row.get("device") and row["device"] != "cpu":
            report.data["env"]["gpu"] = row["device"]
        report.data["rows"].append(row)
        add_efficiency(report.data["rows"])
        report.save()
    report.finish([("ZeRO-3 data-parallel distillation step", "rows", COLUMNS)])
    return 0 if all("tok_per_s" in r for r in report.data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
