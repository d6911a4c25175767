#!/usr/bin/env python
"""Teacher -> zero-shot student: python tools/calibrate.py --teacher DIR --init NAME --keep LAYERS|--policy NAME --text FILE|--token-store PREFIX --tokens N --out DIR"""
import sys

from megatron_tc.calibrate.cli import calibrate_main

if __name__ == "__main__":
    sys.exit(calibrate_main())
