#!/usr/bin/env python
"""Host operators and CPU time of the statistics pass: sweep 2 per converted layer, and a whole pass (CPU).

    python tools/bench/stats_host.py [--preset smollm2-135m] [--readout taylor_calibrate]
        [--tokens 64] [--repeats 15] [--stack 8] [--pass-tokens 32] [--quick]

Prints one JSON line per piece of work: `default` (one layer's default GDN init), `build` (one
layer's readout mixer from it, once per layer and pass), the readout mixers of --stack layers built
together (as sweep 2 builds a group), `sums` (one batch's readout sums of that layer) and the same
sums of --stack layers in one call; per layer: PyTorch operators dispatched and the process's CPU
ms (min / median / max). Then per pass: the plain forward and `collect_stats` of a teacher with
the preset's layers and heads at small widths (two batches of one row of --pass-tokens tokens),
the pass's time as a multiple of the forward's (`x_forward`). Run with OMP_NUM_THREADS=1 to
compare revisions.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402
from megatron_tc.bench.stats_host import measure, measure_pass  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    p.add_argument("--readout", default="taylor_calibrate", help="the strategy whose readout mixer is built")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the batch the sums read")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--stack", type=int, default=8, help="layers of the stacked sums' call and of the group build")
    p.add_argument("--pass-tokens", type=int, default=32, help="tokens of each of the whole pass's two batches")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 3 repeats (seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.repeats, args.tokens, args.pass_tokens = "tiny", 3, 16, 16
    rows = measure(PRESETS[args.preset](), args.readout, args.tokens, args.repeats, args.stack)
    rows += measure_pass(PRESETS[args.preset](), args.readout, args.pass_tokens, args.repeats)
    for row in rows:
        print(json.dumps({"preset": args.preset, "readout": args.readout, "tokens": args.tokens, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
