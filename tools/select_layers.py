#!/usr/bin/env python
"""Retained-layer policy: python tools/select_layers.py --teacher DIR --policy NAME --text FILE|--token-store PREFIX --out keep.json"""
import sys

from megatron_tc.calibrate.cli import select_main

if __name__ == "__main__":
    sys.exit(select_main())
