#!/usr/bin/env python
"""Perplexity / KL / top-1 agreement of a model (HF dir, .gguf or megatron_tc checkpoint) on a text file.

    python tools/evaluate.py --model DIR [--teacher DIR] --text FILE --seq-len N --max-tokens N --json
"""
import sys

from megatron_tc.eval.cli import evaluate_main

if __name__ == "__main__":
    sys.exit(evaluate_main())
