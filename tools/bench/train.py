#!/usr/bin/env python
"""Stage-2 distillation step on one device: teacher forward (no grad) + student forward/backward
on the KL loss + optimizer step, bf16, GDN layers on fla's kernels; tokens/s and MFU.

    python tools/bench/train.py [--out FILE] [--quick] [--models smollm2-135m,llama-1b]
        [--batch 8 --seq 2048] [--steps 5] [--deepspeed] [--trainable all] [--profile]
        [--variants reference,chunked-loss,fused]

Plain torch (default): fp32 student weights under bf16 autocast, fused AdamW; the teacher in
bf16. --deepspeed: the student through `megatron_tc.parallel.deepspeed_engine` (ZeRO-3 on one
rank, bf16, fp32 master weights), as stage 2 runs it. The loss is `distill.losses.distill_loss`
(KL at temperature 1) on random token ids.

--variants times several forms of the same step in one run (one row each, same models and
trainer), so one call compares them:
  reference     the whole-batch fp32 vocabulary losses (impl="reference") and the eager model
                blocks (MEGATRON_TC_COMPILE=0)
  chunked-loss  the chunked vocabulary losses (`parallel.chunked_losses`, compiled per chunk), the
                eager model blocks
  fused         the chunked losses and the compiled model blocks (`model.fused`): stage 2's step

Check before timing: one forward/backward at [1, 512] with the GDN layers on fla under bf16
autocast against the PyTorch chunked backend in fp32 (same weights, same teacher logits):
relative error of the loss and of all gradients together (global), next to the same errors of
the PyTorch chunked backend under the same autocast (the bf16 baseline: fla is right when its
global error is about the baseline's), plus per-tensor errors (median, worst; the worst is a
tiny-gradient tensor, dt_bias / b_proj.bias, whose per-token terms cancel).

MFU = model FLOPs per step / step time / measured bf16 matmul rate (8192^3 bf16 product, this
run). Model FLOPs (megatron_tc/bench/models.py): student 3 x forward (trainable=all; else
2 x forward + 2 N_trainable per token) + teacher 1 x forward, forward = 2 N per token + causal
attention 4 H D (T+1)/2 per token and layer + GDN chunk terms; embeddings excluded; the recompute
of --activation-checkpointing is not counted.

Memory (CUDA): the allocator's peak (allocated and reserved) over the timed steps; one more step
with the peak of forward + backward and of the optimizer step read apart; the bytes one layer of
each kind keeps for backward (`bench.activation_memory`) against the memory plan's per-layer term;
for --deepspeed runs the plan (`tools/plan.py`) of the same step next to the measured peak.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402
from megatron_tc.bench.train_run import VARIANTS, parse_variants, run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"presets: {', '.join(PRESETS)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compilation)")
    p.add_argument("--trainable", default="all", choices=("all", "mixers", "gdn"))
    p.add_argument("--deepspeed", action="store_true", help="student under DeepSpeed ZeRO-3 (one rank)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute every student layer in backward")
    p.add_argument("--deepspeed-config", default=None,
                   help="DeepSpeed JSON instead of configs/deepspeed/zero3.json ('auto' values filled as in stage 2)")
    p.add_argument("--profile", action="store_true", help="torch.profiler over 2 more steps: top kernels")
    p.add_argument("--check-t", type=int, default=512, help="tokens of the gradient check (0: no check)")
    p.add_argument("--variants", default="reference,chunked-loss,fused",
                   help=f"comma list of {', '.join(VARIANTS)} (see the module docstring); a row each")
    args = parse_args(p, argv, dict(models="tiny", batch=2, seq=64, steps=2, warmup=1, check_t=48))
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as exc:
        p.error(str(exc))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
