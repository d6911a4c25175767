#!/usr/bin/env python
"""Inference: hybrid student (a quarter of the layers attention, `uniform` policy) vs its teacher
(all attention): prefill tokens/s, decode tokens/s at long context, cache memory.

    python tools/bench/inference.py [--out FILE] [--quick] [--models smollm2-135m,llama-1b]
        [--gguf SmolLM2.gguf] [--prefill 4096,32768,131072] [--decode-context 32768]
        [--decode-batches 1,8,32] [--decode-steps 32] [--no-graph] [--roles teacher,student]
        [--sdpa-backend default|flash|cudnn|efficient|math] [--profile-decode]

Both models are `HybridLM` with `HybridCache`, bf16, the GDN layers on fla's kernels (chunked
for prefill, fused recurrent for decoding). Random weights unless --gguf gives the SmolLM2
teacher (speed does not depend on the values). Per model and role:

- check: logits of prefill + 4 cached decoding steps against one full forward (rel. error), with
  the same check in fp32 (PyTorch backends: exact) and the model's bf16-vs-fp32 error beside it;
- prefill: one forward over [1, T] with a cache, hidden states only, LM head on the last token;
- decode at --decode-context: prefill [B, ctx] (not timed), then (a) eager: --decode-steps
  greedy steps through `model(token, cache=cache)`, the project's decoding loop, and (b) graph:
  one decoding step at that context captured in a CUDA graph and replayed (no Python or launch
  overhead: each replay recomputes the same step from the same cache); (c) static graph: a real
  greedy loop of --decode-steps tokens, each a replay of one `StaticDecoder` step captured once
  (megatron_tc/bench/static_decode.py: static KV buffers, device-side length);
- floor: bytes a step must read (weights, KV, 2 x GDN state) over the measured copy bandwidth.
Summary: student/teacher ratios against the goals (decode >= 3x, cache <= 30% of the teacher's).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.common import parse_args  # noqa: E402
from megatron_tc.bench.inference_run import run  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"presets: {', '.join(PRESETS)}")
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF: real teacher weights for smollm2-135m")
    p.add_argument("--prefill", default="4096,32768,131072", help="prefill lengths (batch 1)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of N tokens (0: one pass)")
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-batches", default="1,8,32", help="decode batch sizes (OOM is recorded, not fatal)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--check-t", type=int, default=300)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decoding step")
    p.add_argument("--roles", default="teacher,student", help="which of teacher,student to run")
    p.add_argument("--sdpa-backend", default="default", choices=("default", "flash", "cudnn", "efficient", "math"),
                   help="restrict torch's SDPA to one backend (torch.nn.attention.sdpa_kernel)")
    p.add_argument("--profile-decode", action="store_true",
                   help="profile 4 eager decoding steps at the first batch size: host time by op, launches per step")
    p.add_argument("--budget-ms", type=float, default=1500.0, help="timed milliseconds per row")
    args = parse_args(p, argv, dict(models="tiny", prefill="64", decode_context=64, decode_batches="1,2",
                                    decode_steps=4, check_t=40, budget_ms=20.0))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
