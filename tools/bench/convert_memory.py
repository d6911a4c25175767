#!/usr/bin/env python
"""Peak resident memory of HF -> TP=2 x PP=2 conversion and TP=4 x PP=1 resharding of a random
checkpoint with Llama-3-8B's exact shape, and logits parity on a 2-layer cut of it (CPU).

    python tools/bench/convert_memory.py [--layers 32] [--work runs/convert_memory]
        [--out docs/results/convert_memory.json]
"""
import sys

from megatron_tc.bench.convert_memory import main

if __name__ == "__main__":
    sys.exit(main())
