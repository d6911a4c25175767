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
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402
from megatron_tc.bench.scaling import check_model, run_driver  # noqa: E402
from megatron_tc.bench.scaling_worker import run_worker  # noqa: E402


@command_line
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
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (fla compiles during the first; one warm-up step is too few)")
    p.add_argument("--trainable", default="all", choices=("all", "mixers", "gdn"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per N before the job is killed")
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON instead of configs/deepspeed/zero3.json (what stage 2 starts from)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parse_args(p, argv, dict(model="tiny", batch=2, seq=64, steps=3, warmup=1, device="cpu", timeout=120.0))
    check_model(args)
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args, Path(__file__))


if __name__ == "__main__":
    sys.exit(main())
