#!/usr/bin/env python
"""A teacher's own perplexity with and without BOS-prefixed windows: megatron_tc's evaluation
(`tools/evaluate.py`'s path) against transformers' loss on the same windows.

    python tools/bench/bos_perplexity.py --model TEACHER(.gguf | HF dir) --text FILE \
        [--seq-len 1024 --max-tokens 4096] [--out FILE.json]

Rows: `bos` (every window BOS + seq_len-1 tokens, all of them scored) and `no_bos` (plain windows
of seq_len tokens, the first of each unscored), each as megatron_tc computes it
(`eval.perplexity.evaluate_text`) and as transformers does (`model(input_ids=w, labels=w).loss`
per window, weighted by its predicted tokens), with their relative difference. The row the BOS
rule picks for this teacher's tokenizer (`megatron_tc.data.bos.tokenizer_adds_bos`) is marked.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.bos_perplexity import run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory or .gguf (the teacher)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
