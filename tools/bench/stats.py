#!/usr/bin/env python
"""Statistics pass vs a plain teacher forward over the same tokens, and the calibration wall time
of SmolLM2 (statistics + `taylor_calibrate` closed form + per-layer alignment).

    python tools/bench/stats.py [--out FILE] [--quick] [--gguf SmolLM2.gguf | --preset llama3-8b] [--batch 4 --seq 2048
        --num-batches 2] [--readout taylor_calibrate] [--calib-tokens 8192 --calib-seq 512]
        [--align-steps N] [--no-calibrate | --calibrate-only] [--packed-docs [MEAN]] [--sweep1-reference]
        [--profile] [--phases [REPEATS]] [--kernel-configs [--kernel-shapes B,H,HKV,T,D ...]]

Teacher: SmolLM2-135M from --gguf, else random weights of the --preset shape (default SmolLM2-135M;
llama3-8b for the pass at the scale of a real teacher); bf16 on CUDA (--dtype).
Tokens: random ids (the cost does not depend on them). The converted layers are those of the
`uniform` policy keeping a quarter of the layers as attention.

Rows (median ms over the same batches): plain forward `teacher(ids)` (full logits, no grad);
sweep 1 `calibrate.stats.collect_attention_stats` (attention moments, probabilities chunk by
chunk of queries); sweep 2 `collect_readout_stats` (readout sums of --readout); their ratios
to the forward (goal: the statistics pass <= 1.5x); and the pass as the pipeline runs it,
`collect_stats` with both sweeps from one teacher forward per batch, on CUDA also with the per-layer
CUDA graphs ($MEGATRON_TC_STATS_GRAPHS=1) and their sums checked against the eager ones. Sweep 1 takes the fused Triton kernel on CUDA
(`calibrate/moments_triton.py`, column impl); --sweep1-reference adds a row timing sweep 1 with
the PyTorch chunks ($MEGATRON_TC_STATS_KERNEL=reference), not counted in the total, so one run
measures the kernel's gain. --profile runs each sweep and collect_stats once more under
torch.profiler and reports their host and device self time, in total and for the heaviest
operators (is it bound by the host?), on CUDA the device's busy time against the call's wall time,
and the host time and launched device time of each phase of the pass (its `stats.*` profiler
ranges: sweep 1's stacked sums and finish, sweep 2's closed forms, sums and finish), and
counts the host's waits for the device (CUDA sync debug mode) in each sweep, in collect_stats and
in a calibration with 10 alignment steps.
Checks: sweep-1 sums of one [1, 256] batch on the device against the same pass of an fp32 copy of
the teacher on the CPU; with --sweep1-reference also the kernel's sums against the PyTorch chunks'
on the device (same teacher and dtype).

Calibration: `calibrate.student.calibrate_student(teacher, keep, "taylor_calibrate", ...)` over
--calib-tokens tokens in rows of --calib-seq, timed wall clock after a warm-up (first uses compile:
the GDN kernels in fp32 and in the alignment's dtype, then the whole calibration with 2 alignment
steps); goal <= 60 s on one H200. --calibrate-only times the calibration alone (no checks, no sweep rows).
--phases times, alternating in one process, where the pipeline's pass spends its time
(`megatron_tc/bench/stats_phases.py`) and nothing else; --out holds the rounds measured so far after
each one.
--kernel-configs times sweep 1's fused kernel alone under each launch configuration (key block,
warps, pipeline stages) beside causal flash attention on the same bf16 q/k/v (CUDA only), on
--kernel-shapes (default: SmolLM2's 22 converted layers stacked, a 4 x 2048 batch; eight layers
of an 8B Llama-3 shape at 4k), and nothing else.
--packed-docs calibrates on rows of random documents packed with their doc_ids, one row per batch,
as the pipeline's calibration source gives them (else rows without boundaries, four per batch).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402
from megatron_tc.bench.stats_run import run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF (else random weights of its shape)")
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS),
                   help="the teacher's shape, random weights (ignored with --gguf or --quick)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="teacher dtype (default bf16 on CUDA)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--num-batches", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=128, help="queries per attention-probability chunk")
    p.add_argument("--readout", default="taylor_calibrate", help="strategies of sweep 2 ('' for none)")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-seq", type=int, default=512)
    p.add_argument("--align-steps", type=int, default=None, help="override taylor_calibrate's 300 steps per layer")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--calibrate-only", action="store_true", help="only the calibration wall time (no checks, no sweeps)")
    p.add_argument("--packed-docs", type=int, nargs="?", const=512, default=0, metavar="MEAN_TOKENS",
                   help="calibrate on rows of packed documents with doc_ids, one row per batch, as the pipeline's "
                        "calibration source gives them (document lengths exponential, mean 512 tokens or as given)")
    p.add_argument("--sweep1-reference", action="store_true",
                   help="also time sweep 1 with the PyTorch chunks (and check the kernel against them)")
    p.add_argument("--budget-ms", type=float, default=2000.0)
    p.add_argument("--phases", type=int, nargs="?", const=5, default=0, metavar="REPEATS",
                   help="only the phases of the pass (stats_phases.py): collect_stats with sweep 1 and sweep 2 timed "
                        "apart, with CUDA graphs, with a readout call per layer, with sweep 2's groups as many layers "
                        "as fit then the rest, with fp32 projections, and sweep 1 alone (with and without the layer "
                        "I/O kept, a call per layer), alternating over REPEATS rounds (default 5) beside a teacher "
                        "forward")
    p.add_argument("--profile", action="store_true",
                   help="profile one warm call of each sweep and of collect_stats (host and device time, "
                        "heaviest operators, each phase's host time) and count the host's waits for the device")
    p.add_argument("--kernel-configs", action="store_true",
                   help="only sweep 1's kernel under each launch configuration, beside flash attention (CUDA)")
    p.add_argument("--kernel-shapes", nargs="+", default=["4,198,66,2048,64", "1,256,64,4096,128"],
                   metavar="B,H,HKV,T,D", help="q/k/v shapes of --kernel-configs")
    args = parse_args(p, argv, dict(batch=2, seq=64, num_batches=2, chunk_size=16, calib_tokens=256, calib_seq=32,
                                    align_steps=3, budget_ms=50.0))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
