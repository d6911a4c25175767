"""A teacher's perplexity with and without BOS-prefixed windows (tools/bench/bos_perplexity.py):
megatron_tc's evaluation against transformers' own loss on the same windows."""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_tc.bench.common import Report
from megatron_tc.data.bos import tokenizer_adds_bos
from megatron_tc.eval.loading import load_model
from megatron_tc.eval.perplexity import evaluate_text, tokenize_file


@torch.no_grad()
def transformers_ppl(module: torch.nn.Module, ids: list[int], seq_len: int,
                     bos_id: int | None) -> tuple[float, int]:
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


def run(args: Any) -> int:
    """Both window kinds of args.model over args.text, each by megatron_tc and by transformers."""
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
