#!/usr/bin/env python
"""Check a finished `bash launch/distill.sh` run (e.g. configs/gpu_smoke.yaml) for what a
multi-GPU smoke test must show, and print one line per check:

    python tools/bench/check_smoke.py RUN_DIR --log LAUNCH_LOG --world N [--precision bf16]
        [--cuda] [--kernels-since MARKER]

  every stage of the manifest 'complete', run on N ranks (manifest and DeepSpeed's launcher log:
  `dist_world_size=N`, N local slots); the config's precision; --cuda: torch is a CUDA build, fla
  imports, and (with --kernels-since) fla's GDN Triton kernels were compiled into
  $TRITON_CACHE_DIR after MARKER was touched (the run used fla: nothing else compiles them);
  stage-1/2 losses finite; the exported HF directory exists. Exit status 1 when a check fails.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.smoke_check import check_smoke_run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--log", type=Path, required=True, help="stdout+stderr of launch/distill.sh")
    ap.add_argument("--world", type=int, required=True, help="expected ranks (the visible GPUs)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--kernels-since", type=Path, default=None)
    args = ap.parse_args(argv)
    return check_smoke_run(args.run_dir, args.log, args.world, args.precision, args.cuda, args.kernels_since)


if __name__ == "__main__":
    sys.exit(main())
