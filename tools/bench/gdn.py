#!/usr/bin/env python
"""Gated DeltaNet op vs softmax attention: fla's chunk kernel, the PyTorch chunked path and SDPA
causal attention (flash on CUDA), forward and forward+backward, over sequence lengths.

    python tools/bench/gdn.py [--out FILE] [--quick] [--heads 9x64,16x128] [--shapes 8x2048,1x8192,...]

Inputs: q, k, v [B, T, H, D] in --dtype (bf16 on CUDA), g = logsigmoid(randn) and
beta = sigmoid(randn) [B, T, H] in fp32 (what the GDN layer passes), q/k L2-normalized inside
the op; SDPA gets q, k, v [B, H, T, D] (as many KV heads as query heads). Before timing, every
method is checked per head shape against a float64 reference at B=2, T=300: the recurrent
gated delta rule for GDN (output and the gradients of q, k, v, g, beta), math SDPA for attention;
the table reports the largest ||x - ref|| / ||ref||. Fresh random inputs for every row.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.gdn_op import run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None, help="JSON result file (default runs/bench/bench_gdn.json)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run, seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--heads", default="9x64,16x128", help="HxD list")
    p.add_argument("--shapes", default="8x2048,1x8192,1x32768,1x131072", help="BxT list")
    p.add_argument("--methods", default="fla,torch-chunk,sdpa")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--chunk-max-t", type=int, default=32768,
                   help="skip the PyTorch chunked path above this T (T/64 sequential chunk steps)")
    p.add_argument("--check-t", type=int, default=300)
    p.add_argument("--budget-ms", type=float, default=400.0, help="timed milliseconds per row")
    args = parse_args(p, argv, dict(heads="2x16", shapes="2x128,1x256", check_t=100, budget_ms=20.0))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
