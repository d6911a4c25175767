#!/usr/bin/env python
"""Peak resident memory per rank of loading a teacher of Llama-3-8B's widths whole against split
over TP = 2 and 4 gloo ranks, each reading only its slice of the checkpoint (CPU).

    python tools/bench/sharded_teacher.py [--layers 2] [--tp 2 4] [--out docs/results/sharded_teacher_memory.json]
"""
import sys

from megatron_tc.bench.sharded_teacher import main

if __name__ == "__main__":
    sys.exit(main())
