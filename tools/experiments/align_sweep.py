#!/usr/bin/env python
"""Experiment: per-layer alignment settings compared on held-out calibration tokens (no evaluation
text is read). For a few converted layers, each (init, settings) pair is aligned alone, teacher-forced,
and scored by the relative MSE on held-out calibration rows, the quantity the alignment minimizes.

    python tools/experiments/align_sweep.py --teacher T --text CAL --stats S --tokens 2048 \
        --heldout-tokens 1024 --layers 0,1,2,9,20 --steps 40 --configs tc,ours,ours-cos
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from megatron_tc.calibrate.align import align_layer, collect_layer_io, relative_mse
from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.calibrate.strategies import PAPER_ALIGN, TAYLOR_FIT_ALIGN, get_strategy
from megatron_tc.calibrate.student import build_student
from megatron_tc.calibrate.teacher_io import load_teacher, text_batches

CONFIGS = {  # name -> (init, settings)
    "tc": ("taylor_calibrate", PAPER_ALIGN),
    "tc-heldout": ("taylor_calibrate", TAYLOR_FIT_ALIGN),
    "ours": ("taylor_fit", TAYLOR_FIT_ALIGN),
    "ours-cos": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, schedule="cosine")),
    "ours-proj1e-3": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, lr_proj=1e-3)),
    "ours-proj1e-3-cos": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, lr_proj=1e-3, schedule="cosine")),
    "ours-gates3e-3": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, lr_gates=3e-3)),
    "ours-gates3e-2-cos": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, lr_gates=3e-2, schedule="cosine")),
    "ours-rows2": ("taylor_fit", replace(TAYLOR_FIT_ALIGN, batch_rows=2)),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--teacher", "--text", "--stats"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heldout-tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--layers", default="0,1,2,9,20")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--configs", default="tc,ours,ours-cos")
    ap.add_argument("--ours-readout", default=None, help="read ours' readout sums under this name (older stats files)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    teacher = load_teacher(args.teacher)
    stats = TaylorStats.load(args.stats, teacher_sha256=teacher.sha256)
    layers = [int(x) for x in args.layers.split(",")]
    pattern = "".join("G" if i in layers else "A" for i in range(teacher.model.arch.num_layers))
    train = collect_layer_io(teacher.model, text_batches(args.text, teacher.tokenizer, args.tokens, args.seq_len), layers)
    held = collect_layer_io(teacher.model, text_batches(args.text, teacher.tokenizer, args.heldout_tokens, args.seq_len,
                                                        skip_tokens=args.tokens), layers)
    results = {}
    for name in args.configs.split(","):
        init, settings = CONFIGS[name]
        settings = replace(settings, steps=args.steps)
        strategy = get_strategy(init)
        if args.ours_readout and init.startswith("taylor_fit"):
            strategy.readout_key = args.ours_readout
        student = build_student(teacher.model, pattern, strategy, stats, teacher_sha256=teacher.sha256)
        row = {}
        t0 = time.time()
        for layer in layers:
            mixer = student.layers[layer].mixer
            before = relative_mse(mixer, held[layer])
            rep = align_layer(mixer, train[layer], settings, held[layer], seed=layer)
            row[layer] = (round(before, 4), round(relative_mse(mixer, held[layer]), 4), rep["best_step"])
        results[name] = row
        print(json.dumps({"config": name, "steps": args.steps, "tokens": args.tokens, "seconds": round(time.time() - t0),
                          "heldout_before_after_beststep": row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
