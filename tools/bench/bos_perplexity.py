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
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.bench.common import Report  # noqa: E402
from megatron_tc.data.bos import tokenizer_adds_bos  # noqa: E402
from megatron_tc.eval.loading import load_model  # noqa: E402
from megatron_tc.eval.perplexity import evaluate_text, tokenize_file  # noqa: E402


@torch.no_grad()
def transformers_ppl(module: torch.nn.Module, ids: list[int], seq_len: int, bos_id: int | None) -> tuple[float, int]:
    """exp of transformers' mean loss over windows cut here (BOS + seq_len-1 tokens, or seq_len
    tokens), each weighted by its predicted tokens."""
    step = seq_len - (bos_id is not None)
    nll, count = 0.0, 0
    for start in range(0, len(ids), step):
        window = ([bos_id] if bos_id is not None else []) + ids[start:start + step]
        if len(window) < 2:
            continue
        x = torch.tensor([window])
        nll += float(module(input_ids=x, labels=x, use_cache=False).loss) * (len(window) - 1)
        count += len(window) - 1
    return math.exp(nll / count), count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory or .gguf (the teacher)")
    ap.add_argument("--text", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report("bos_perplexity", args.out, torch.device("cpu"), args)
    model = load_model(args.model, device="cpu", dtype="float32")
    tok = model.tokenizer
    rule = tokenizer_adds_bos(tok)
    report.note(f"tokenizer {type(tok).__name__}: bos_token {tok.bos_token!r} (id {tok.bos_token_id}); "
                f"adds BOS to encoded text: {rule}")
    ids = tokenize_file(args.text, tok, args.max_tokens).tolist()
    for name, bos_id in (("bos", tok.bos_token_id), ("no_bos", None)):
        ours = evaluate_text(model, args.text, tok, args.seq_len, args.max_tokens, bos_id=bos_id, progress=False)
        ref, ref_tokens = transformers_ppl(model.module, ids, args.seq_len, bos_id)
        report.add("rows", {"windows": name, "rule_picks": (bos_id is not None) == rule, "ppl": ours.ppl,
                            "transformers_ppl": ref, "rel_diff": ours.ppl / ref - 1, "tokens": ours.tokens,
                            "transformers_tokens": ref_tokens, "n_windows": ours.windows})
    report.finish([("teacher perplexity", "rows", ["windows", "rule_picks", "ppl", "transformers_ppl", "rel_diff",
                                                   "tokens", "n_windows"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
