"""Peak resident memory per rank of loading a teacher whole against split over TP ranks (CPU).

A megatron_tc checkpoint with Llama-3-8B's widths (hidden 4096, FFN 14336, 32 heads, 8 KV heads,
vocabulary 128256, untied head) and `--layers` layers is written in bf16 with one shard (TP = 1:
every split rank re-slices it, the hardest layout for reading). Then, each in fresh processes:
the whole teacher as the pipeline loads it (`calibrate.teacher_io.load_teacher`, fp32, with its
weight hash), and the teacher split over TP = 2 and TP = 4 gloo ranks
(`calibrate.teacher_io.load_sharded_teacher`: each rank reads its slice; rank 0 also streams the
whole teacher's hash). Each rank reports its resident set size before the load, its peak
(VmHWM) after it, and the bytes of the weights it holds. The weights are zeros: what is measured is
memory and reading, not values (the parity tests cover those).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatron_tc.config.errors import command_line

GIB = 2**30


def write_teacher(directory: Path, num_layers: int) -> int:
    """A bf16 zero checkpoint (TP = 1) of Llama-3-8B's widths; returns its weight bytes."""
    from megatron_tc.bench.convert_memory import llama3_8b_config
    from megatron_tc.convert.checkpoint import save_checkpoint
    from megatron_tc.convert.hf_to_megatron import arch_of_hf_config
    from megatron_tc.convert.lazy import Zeros
    from megatron_tc.data.synthetic import train_tiny_tokenizer
    from megatron_tc.model import HybridLM

    arch = arch_of_hf_config(llama3_8b_config(num_layers))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in HybridLM(arch).state_dict().items()}
    lazies = {name: Zeros(shape, torch.bfloat16) for name, shape in shapes.items()}
    # the pipeline's teacher carries a tokenizer: a tiny one stands in (nothing is tokenized here)
    vocab_dir = train_tiny_tokenizer(directory.parent / "tokenizer", vocab_size=320)
    files = {f.name: f.read_bytes() for f in Path(vocab_dir).iterdir() if f.is_file()}
    save_checkpoint(lazies, arch, directory, tokenizer_files=files, overwrite=True)
    return sum(lazy.nbytes() for lazy in lazies.values())


def _status_mib(field: str) -> float:
    """A /proc/self/status memory field in MiB: VmRSS (now) or VmHWM (peak of this process image;
    getrusage's peak would include the parent's, as Linux keeps it across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load_whole(ckpt: str, out: str) -> None:
    from megatron_tc.calibrate.teacher_io import load_teacher

    before, start = _status_mib("VmRSS"), time.perf_counter()
    teacher = load_teacher(ckpt)
    record = {"rank": 0, "before_mib": before, "peak_mib": _status_mib("VmHWM"),
              "held_bytes": _held_bytes(teacher.model), "seconds": time.perf_counter() - start}
    Path(f"{out}.0").write_text(json.dumps(record))


def load_split(rank: int, world_size: int, ckpt: str, out: str) -> None:
    from megatron_tc.calibrate.teacher_io import load_sharded_teacher
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(tp=world_size)
    before, start = _status_mib("VmRSS"), time.perf_counter()
    teacher = load_sharded_teacher(ckpt, ctx)
    record = {"rank": rank, "before_mib": before, "peak_mib": _status_mib("VmHWM"),
              "held_bytes": _held_bytes(teacher.model), "seconds": time.perf_counter() - start}
    Path(f"{out}.{rank}").write_text(json.dumps(record))


def measure(ckpt: Path, work: Path, tp: int) -> list[dict[str, Any]]:
    """Per-rank records of one load in fresh processes (tp = 1: the whole teacher)."""
    from megatron_tc.testing import run_distributed

    out = str(work / f"load_tp{tp}")
    if tp == 1:
        run_distributed(_whole_rank, 1, str(ckpt), out, timeout=3600)
    else:
        run_distributed(load_split, tp, str(ckpt), out, timeout=3600)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(tp)]


def _whole_rank(rank: int, world_size: int, ckpt: str, out: str) -> None:
    load_whole(ckpt, out)


def row(tp: int, records: list[dict[str, Any]]) -> list[str]:
    peak = max(r["peak_mib"] for r in records) / 1024
    grown = max(r["peak_mib"] - r["before_mib"] for r in records) / 1024
    held = max(r["held_bytes"] for r in records) / GIB
    seconds = max(r["seconds"] for r in records)
    layout = "whole (load_teacher)" if tp == 1 else f"split over TP = {tp} (load_sharded_teacher)"
    return [layout, f"{held:.2f}", f"{grown:.2f}", f"{peak:.2f}", f"{seconds:.0f}"]


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4],
                   help="TP sizes to split over (the whole load always runs)")
    p.add_argument("--work", default="runs/sharded_teacher", help="scratch directory (git-ignored)")
    p.add_argument("--out", default="docs/results/sharded_teacher_memory.json")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        weight_bytes = write_teacher(work / "teacher", args.layers)
        print(f"wrote {weight_bytes / GIB:.2f} GiB of bf16 weights", flush=True)
        rows = []
        for tp in [1, *args.tp]:
            records = measure(work / "teacher", work, tp)
            rows.append(row(tp, records))
            print(rows[-1], records, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "kind": "table",
        "what": (f"Loading a teacher of Llama-3-8B's widths with {args.layers} layers "
                 f"(a {weight_bytes / GIB:.2f} GiB bf16 checkpoint with one shard, loaded in fp32) on CPU, in fresh "
                 "processes: per rank, the fp32 weights it holds, how much its peak resident memory grew during the "
                 "load, that peak, and the load's wall time (slowest rank; rank 0 also hashes the whole teacher, "
                 "streamed)"),
        "date": dt.date.today().isoformat(), "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "software": {"python": platform.python_version(), "torch": torch.__version__},
        "config": f"Llama-3-8B widths, {args.layers} layers, untied head; gloo ranks on one machine",
        "command": " ".join(["python", "tools/bench/sharded_teacher.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "bos": None,
        "columns": ["teacher", "weights held per rank (GiB)", "peak growth per rank (GiB)",
                    "peak resident per rank (GiB)", "wall (s)"],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0
