#!/usr/bin/env python
"""Rewrite a megatron_tc checkpoint with another TP x PP, shard to shard.

    python tools/reshard.py --ckpt DIR --out DIR --tp N --pp N [--overwrite]
"""
import sys

from megatron_tc.convert.cli import reshard_main

if __name__ == "__main__":
    sys.exit(reshard_main())
