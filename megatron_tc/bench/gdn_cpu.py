"""CPU micro-benchmark of the gated delta rule (tools/bench/gdn_cpu.py): the chunked PyTorch
kernel against the step-by-step recurrence, forward and forward+backward."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_tc.model.ops import gated_delta_rule


def inputs(b: int, t: int, h: int, d: int, grad: bool) -> dict[str, torch.Tensor]:
    x = dict(
        q=torch.randn(b, t, h, d), k=torch.randn(b, t, h, d), v=torch.randn(b, t, h, d),
        g=-torch.rand(b, t, h) * 0.5, beta=torch.rand(b, t, h),
    )
    return {n: v.requires_grad_(grad) for n, v in x.items()}


def time_one(backend: str, args: argparse.Namespace, backward: bool) -> float:
    times = []
    for rep in range(args.repeats + 1):
        x = inputs(args.batch, args.seq, args.heads, args.dim, backward)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            o, _ = gated_delta_rule(**x, use_qk_l2norm=True, chunk_size=args.chunk, backend=backend)
            if backward:
                o.sum().backward()
        if rep:  # the first run is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)



def run(args: argparse.Namespace) -> None:
    """Prints the setting with the chunk-vs-recurrent difference, then a row per pass."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = inputs(args.batch, args.seq, args.heads, args.dim, False)
    o_c, _ = gated_delta_rule(**x, use_qk_l2norm=True, chunk_size=args.chunk, backend="chunk")
    o_r, _ = gated_delta_rule(**x, use_qk_l2norm=True, backend="recurrent")
    diff = ((o_c - o_r).abs().max() / o_r.abs().max()).item()
    print(f"B={args.batch} T={args.seq} H={args.heads} D={args.dim} chunk={args.chunk} fp32 "
          f"threads={args.threads} repeats={args.repeats} (max rel diff chunk vs recurrent {diff:.1e})")
    print(f"{'pass':<14}{'recurrent ms':>14}{'chunk ms':>12}{'speed-up':>10}")
    for label, backward in (("forward", False), ("fwd+bwd", True)):
        rec, chunk = time_one("recurrent", args, backward), time_one("chunk", args, backward)
        print(f"{label:<14}{rec * 1e3:>14.1f}{chunk * 1e3:>12.1f}{rec / chunk:>9.1f}x")
