#!/usr/bin/env python
"""Taylor statistics pass: python tools/stats.py --teacher DIR --text FILE|--token-store PREFIX --tokens N --out stats.pt"""
import sys

from megatron_tc.calibrate.cli import stats_main

if __name__ == "__main__":
    sys.exit(stats_main())
