"""Data-parallel scaling benchmark's driver (tools/bench/scaling.py): one torchrun job per rank
count N, one after the other, each in its own process group (a timeout or a signal ends every
rank), with NVLink multicast off; tokens/s per N and the efficiency tok/s(N) / (N * tok/s(1))."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron_tc.config.errors import InputError
from megatron_tc.bench.common import Report
from megatron_tc.bench.models import PRESETS
from megatron_tc.bench.scaling_worker import MULTICAST_OFF

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["N", "model", "B", "T", "step_ms", "tok_per_s", "tok_per_s_per_gpu", "efficiency", "mfu", "tflops",
           "peak_mem_GiB", "first_step_s", "wall_s", "finite", "note"]


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
    root = str(ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cuda:
        env.setdefault("OMP_NUM_THREADS", "4")
    else:  # gloo ranks share the cores; more threads than cores per rank only thrash
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        env["LOCAL_SIZE"] = str(n)
    return env


def worker_argv(args, result: Path, script: Path) -> list[str]:
    """The worker's command line: `script` (tools/bench/scaling.py) with --worker and the run's shape."""
    out = [str(script.resolve()), "--worker", "--result", str(result), "--model", args.model,
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


def run_one(n: int, args, logs: Path, cuda: bool, script: Path) -> dict:
    """Start the N-rank job; its rank 0's result, or a row with a note on failure/timeout."""
    result = logs / f"ranks{n}.json"
    result.unlink(missing_ok=True)
    log = logs / f"ranks{n}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           *worker_argv(args, result, script)]
    print(f"=== N={n}: {' '.join(cmd)}  (log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        # own process group, so a timeout ends torchrun and every rank it started
        proc = subprocess.Popen(cmd, env=child_env(n, cuda), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(ROOT))
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


def check_model(args: argparse.Namespace) -> None:
    if args.model not in PRESETS:
        raise InputError(f"error: unknown --model {args.model!r}; choose from {', '.join(PRESETS)}")


def run_driver(args: argparse.Namespace, script: Path) -> int:
    """Every rank count of --ranks (default 1, 2, 4, ... up to the GPUs); `script` is the CLI the
    workers run. 0 when every N produced tokens/s."""
    cuda = args.device != "cpu" and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise InputError("error: --device cuda asked for but torch.cuda.is_available() is False")
    if args.ranks:
        counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    else:
        counts = rank_counts(torch.cuda.device_count() if cuda else args.max_ranks)
    if cuda and max(counts) > torch.cuda.device_count():
        raise InputError(f"error: --ranks {args.ranks} asks for {max(counts)} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` around the driver ends the ranks too
    report = Report("scaling", args.out, torch.device("cpu"), args)
    report.data["env"]["device"] = "cuda" if cuda else "cpu"
    report.save()
    logs = report.path.with_name(report.path.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    for n in counts:
        row = run_one(n, args, logs, cuda, script)
        if row.get("device") and row["device"] != "cpu":
            report.data["env"]["gpu"] = row["device"]
        report.data["rows"].append(row)
        add_efficiency(report.data["rows"])
        report.save()
    report.finish([("ZeRO-3 data-parallel distillation step", "rows", COLUMNS)])
    return 0 if all("tok_per_s" in r for r in report.data["rows"]) else 1
