#!/usr/bin/env python
"""Regenerate the tables of docs/results.md, docs/benchmarks.md and README.md (and the figures in
docs/assets) from the curated result files in docs/results; `--check` only compares.

    python tools/results_tables.py [--check] [--no-figures]
"""
import sys

from megatron_tc.eval.results_tables import main

if __name__ == "__main__":
    sys.exit(main())
