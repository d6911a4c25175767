#!/usr/bin/env python
"""Tokenize a corpus with every core into a memory-mapped token store (megatron-core
IndexedDataset .bin/.idx) that the training loader streams.

    python tools/preprocess.py --input corpus/*.jsonl --tokenizer DIR --out data/corpus [--threads N]
"""
import sys

from megatron_tc.data.preprocess_cli import main

if __name__ == "__main__":
    sys.exit(main())
