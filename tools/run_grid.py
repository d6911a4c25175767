#!/usr/bin/env python
"""Run an experiment grid (init strategy x retained-layer policy x teacher) and write a results table.

    python tools/run_grid.py GRID.yaml [--out DIR] [--force] [--fail-fast] [--list]

The grid file format is documented in megatron_tc/eval/grid.py.
"""
import sys

from megatron_tc.eval.grid import grid_main

if __name__ == "__main__":
    sys.exit(grid_main())
