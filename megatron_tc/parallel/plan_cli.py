"""Command line of tools/plan.py: the memory plan of one layout, or a search over layouts of a
node. Bad input exits with status 2 and a one-line error."""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

from megatron_tc.parallel.memory_plan import GIB, PlanError, PlanInput, plan_memory, teacher_arch


def _pattern(num_layers: int, args: argparse.Namespace) -> str:
    if args.student_pattern:
        return args.student_pattern
    from megatron_tc.bench.models import quarter_pattern

    return quarter_pattern(num_layers)


def _row(plan: PlanInput, result: dict[str, Any]) -> str:
    return (f"tp={plan.tp} pp={plan.pp} dp={plan.dp} zero={plan.zero_stage} offload={int(plan.offload_optimizer)} "
            f"teacher={plan.teacher_mode} mbs={plan.micro_batch_size} ckpt={int(plan.activation_checkpointing)}: "
            f"{result['total_gib']:.1f} GiB/GPU, ~{result['tokens_per_s'] / 1e3:.1f}k tok/s")


def search(base: PlanInput, gpus: int, gpu_gib: float, headroom: float = 0.9) -> list[tuple[PlanInput, dict[str, Any]]]:
    """Every layout of `gpus` GPUs whose plan fits `headroom` x `gpu_gib`, fastest first (then
    least memory)."""
    fits, seen = [], set()
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if gpus % (tp * pp):
            continue
        for offload, mode, mbs, ckpt in itertools.product((False, True), ("replicated", "engine"), (1, 2, 4, 8),
                                                          (False, True)):
            mode = mode if pp == 1 else "replicated"
            if (tp, pp, offload, mode, mbs, ckpt) in seen:
                continue
            seen.add((tp, pp, offload, mode, mbs, ckpt))
            plan = PlanInput(**{**base.__dict__, "tp": tp, "pp": pp, "dp": gpus // (tp * pp),
                                "zero_stage": 3 if pp == 1 else 1, "offload_optimizer": offload,
                                "teacher_mode": mode, "micro_batch_size": mbs,
                                "activation_checkpointing": ckpt})
            try:
                result = plan_memory(plan)
            except PlanError:
                continue
            if result["total_bytes"] <= headroom * gpu_gib * GIB:
                fits.append((plan, result))
    fits.sort(key=lambda pr: (-pr[1]["tokens_per_s"], pr[1]["total_bytes"]))
    return fits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bytes per GPU and tokens/s of a stage-2 run (teacher + student)")
    p.add_argument("--teacher", required=True, help="preset (llama3-8b, llama3-70b, llama3-8b-8l, llama-1b, smollm2-135m), an HF "
                                                    "config.json or model directory, or a megatron_tc checkpoint")
    p.add_argument("--student-pattern", help="'A'/'G' per layer (default: a quarter attention, the uniform policy)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--teacher-mode", default="replicated", choices=["replicated", "engine"])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--trainable", default="all", choices=["all", "mixers", "gdn"])
    p.add_argument("--compile", default="auto", choices=["auto", "true", "false"],
                   help="stage 2's parallel.compile (the step model's per-layer cost)")
    p.add_argument("--search", type=int, metavar="GPUS", help="list the layouts of GPUS GPUs that fit --gpu-gib")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (with --search: 90%% is usable)")
    p.add_argument("--top", type=int, default=8, help="with --search: how many layouts to print")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        arch = teacher_arch(args.teacher)
        plan = PlanInput(arch, _pattern(arch.num_layers, args), args.tp, args.pp, args.dp, args.zero_stage,
                         args.offload_optimizer, args.teacher_mode, args.micro_batch, args.seq_len,
                         args.activation_checkpointing, args.trainable, args.compile)
        if args.search:
            fits = search(plan, args.search, args.gpu_gib)[: args.top]
            if args.json:
                print(json.dumps([{"layout": {k: v for k, v in pl.__dict__.items() if k != "teacher"}, **r} for pl, r in fits],
                                 indent=2))
            else:
                print(f"{len(fits)} layouts shown; none fits" if not fits else "\n".join(_row(pl, r) for pl, r in fits))
            return 0
        result = plan_memory(plan)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, value in result["bytes"].items():  # parts: the peak is the larger phase, not their sum
            print(f"{name:16s} {value / GIB:8.2f} GiB")
        phase = {"fwd_bwd": "forward + backward", "step": "the optimizer step"}[result["peak_phase"]]
        print(f"{'total':16s} {result['total_gib']:8.2f} GiB per GPU at its peak, in {phase} (forward + backward "
              f"{result['fwd_bwd_phase_gib']:.2f}, step {result['step_phase_gib']:.2f}); step {result['step_tflop']} TFLOP, "
              f"~{result['step_s']} s, ~{result['tokens_per_s']} tokens/s, MFU ~{result['mfu']:.0%}")
    return 0
