#!/usr/bin/env python
"""Memory plan of a stage-2 run: bytes per GPU for weights, gradients, optimizer, teacher,
activations and loss buffers, and tokens/s from the measured step model.

    python tools/plan.py --teacher llama3-8b --tp 2 --dp 4 --micro-batch 2 --activation-checkpointing
    python tools/plan.py --teacher llama3-70b --search 8 --gpu-gib 141
"""
import sys

from megatron_tc.parallel.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
