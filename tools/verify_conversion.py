#!/usr/bin/env python
"""Max logit difference and top-1 agreement of a checkpoint against its HF model; exit 1 above --tol.

    python tools/verify_conversion.py --hf DIR --ckpt DIR [--tol 1e-4]
"""
import sys

from megatron_tc.convert.cli import verify_conversion_main

if __name__ == "__main__":
    sys.exit(verify_conversion_main())
