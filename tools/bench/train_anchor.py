#!/usr/bin/env python
"""The pipeline's stage-2 step against a plain PyTorch distillation loop, in one process.

    python tools/bench/train_anchor.py [--models smollm2-135m,llama-1b] [--batch 32 --seq 2048]
        [--micro-steps 1] [--zero-stage auto] [--runs 3 --steps 3 --warmup 2] [--profile] [--out FILE] [--quick]
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tools/bench/train_anchor.py ...   (several ranks)

pipeline  `Stage2Trainer.train_step` as `build_stage2` builds it from the quickstart config
          (DeepSpeed at the ZeRO stage parallel.zero_stage=auto picks, bf16 on CUDA, the student's
          and the teacher's decoder layers compiled as parallel.compile=auto and
          parallel.compile_teacher=auto decide)
plain     the same student weights and teacher, torch.compile (CUDA) of the whole student and of the
          whole teacher forward (what a user would write), fused AdamW, bf16 autocast, a
          full-vocabulary KL, torch DDP over several ranks; no DeepSpeed

Random weights of the preset shapes (student: a quarter of the layers kept as attention), random
tokens, the same micro-batches for both. First the losses of both first steps (same weights, same
batch: they must agree), then `--runs` rounds alternating `--steps` timed steps of each after
`--warmup` untimed ones; per path the minimum / median / maximum over the rounds of each round's
median step, and the pipeline's tokens/s as a fraction of the plain loop's, round by round.
--profile then runs one more step of each path under torch.profiler (host and device self time,
heaviest operators: where the two steps differ), and three steps of each with the device drained
at each region's end (data, teacher, student forward, loss, backward, optimizer, rest): the
region that differs between the two paths.
MFU = model FLOPs per step (student 6 x matmul parameters x tokens + attention, teacher 2 x ... +
attention; megatron_tc/bench/models.py) / step time / the matmul rate measured in this process
(bf16 8192^3 on CUDA; fp32 on CPU, summed over the ranks).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.anchor_run import run  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"presets: {', '.join(PRESETS)}")
    p.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-steps", type=int, default=1, help="micro-batches per rank and optimizer step")
    p.add_argument("--zero-stage", default="auto", choices=("auto", "0", "1", "2", "3"),
                   help="the pipeline's parallel.zero_stage (default: what the pipeline picks)")
    p.add_argument("--runs", type=int, default=3, help="rounds (minimum / median / maximum over them)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each path per round (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each path first (compilation)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step of each path (host and device time, heaviest operators) "
                        "and time its regions")
    args = parse_args(p, argv, dict(models="tiny", batch=2, seq=64, runs=3, steps=2, warmup=1))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
