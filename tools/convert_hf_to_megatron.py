#!/usr/bin/env python
"""HF model (dir, .gguf, or dir with one .gguf) -> megatron_tc TP x PP checkpoint.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp N --pp N [--dtype auto|float32|bfloat16|float16] [--overwrite]
"""
import sys

from megatron_tc.convert.cli import convert_hf_to_megatron_main

if __name__ == "__main__":
    sys.exit(convert_hf_to_megatron_main())
