#!/usr/bin/env python
"""megatron_tc checkpoint -> HF directory (family format for teachers, megatron_tc_hybrid for students).

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--overwrite] [--as-student]
"""
import sys

from megatron_tc.convert.cli import convert_megatron_to_hf_main

if __name__ == "__main__":
    sys.exit(convert_megatron_to_hf_main())
