#!/usr/bin/env python
"""Markdown report (tokens-to-target tables, ratios, eval-perplexity plot) from stage-2 run directories.

    python tools/report.py RUN_DIR [RUN_DIR ...] --out DIR [--teacher-ppl X] [--ks 1.10,1.15,1.25]
"""
import sys

from megatron_tc.eval.report import report_main

if __name__ == "__main__":
    sys.exit(report_main())
