#!/usr/bin/env python
"""CPU micro-benchmark: chunked gated delta rule vs the step-by-step recurrence.

    python tools/bench/gdn_cpu.py [--batch 2 --seq 512 --heads 4 --dim 64 --chunk 64 --repeats 5 --threads 1]

Prints median wall time (fresh random inputs each repeat, one warm-up excluded) for forward and
forward+backward, and the speed-up of the chunked kernel; also the max relative difference of
the two outputs as a sanity check.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.gdn_cpu import run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    for name, default in (("batch", 2), ("seq", 512), ("heads", 4), ("dim", 64), ("chunk", 64), ("repeats", 5),
                          ("threads", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
