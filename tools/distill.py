#!/usr/bin/env python
"""The pipeline entry point (one rank); launch/distill.sh starts one per rank.

    python tools/distill.py [CONFIG] [key=value ...] [--force STAGE[,STAGE]] [--stop-after N]

CONFIG defaults to configs/quickstart.yaml. --force reruns the named stages from scratch ('all'
for every one); --stop-after N stops a training stage after N steps with a checkpoint (the same
command then resumes).
"""
from megatron_tc.distill.cli import process_main

if __name__ == "__main__":
    raise SystemExit(process_main())
