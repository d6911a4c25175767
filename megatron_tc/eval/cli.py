"""Command-line entry points of the eval package (tools/evaluate.py is a thin wrapper over these)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megatron_tc.data.bos import bos_record, resolve_bos_id
from megatron_tc.data.documents import DataError
from megatron_tc.eval.loading import ModelLoadError, load_model, load_tokenizer
from megatron_tc.eval.perplexity import EvalInputError, evaluate_text


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Perplexity of a model on a text file; with --teacher also KL(teacher || student) per "
                    "token and top-1 agreement. Non-overlapping windows of --seq-len tokens; the first token "
                    "of each window is not predicted, or, when the teacher's tokenizer adds BOS, every window "
                    "starts with BOS (see megatron_tc/eval/perplexity.py).")
    p.add_argument("--model", required=True, help="HF directory, .gguf, or megatron_tc checkpoint directory")
    p.add_argument("--teacher", help="teacher (same kinds of path as --model); adds kl, top1_agree, teacher_ppl")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--seq-len", type=int, required=True, help="window length in tokens")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens of the text to read (the first N)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | float64")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's, else the teacher's)")
    p.add_argument("--bos", default="auto", choices=("auto", "true", "false"),
                   help="start every window with BOS: auto = when the teacher's tokenizer (else the model's) "
                        "adds BOS to encoded text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tb", default=None,
                   help="TensorBoard log directory: ppl (and teacher_ppl, kl, top1_agree) as eval/*")
    return p


def evaluate_main(argv: list[str] | None = None) -> int:
    args = evaluate_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        model = load_model(args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer)
        teacher = load_model(args.teacher, device=args.device, dtype=args.dtype) if args.teacher else None
        tokenizer = model.tokenizer or (teacher.tokenizer if teacher else None)
        if tokenizer is None:
            tokenizer = load_tokenizer(args.model)  # raises with a message naming --tokenizer
        rule_tokenizer = teacher.tokenizer if teacher is not None and teacher.tokenizer is not None else tokenizer
        bos_id = resolve_bos_id(rule_tokenizer, args.bos)
        result = evaluate_text(model, args.text, tokenizer, seq_len=args.seq_len, max_tokens=args.max_tokens,
                               teacher=teacher, batch_size=args.batch_size, device=args.device,
                               progress=not args.no_progress and sys.stderr.isatty(), bos_id=bos_id)
    except (ModelLoadError, EvalInputError, DataError) as exc:
        print(f"evaluate.py: error: {exc}", file=sys.stderr)
        return 2
    out = {"model": args.model, "teacher": args.teacher, "text": args.text, **result.to_dict(),
           **bos_record(bos_id, args.bos), "dtype": args.dtype, "seconds": round(time.perf_counter() - start, 3)}
    if args.tb:
        from megatron_tc.monitor import TBWriter

        with TBWriter(args.tb) as writer:
            writer.scalars({key: out[key] for key in ("ppl", "teacher_ppl", "kl", "top1_agree")
                            if out.get(key) is not None}, 0, prefix="eval")
    if args.json:
        print(json.dumps(out))
    else:
        for key in ("ppl", "teacher_ppl", "kl", "top1_agree", "tokens", "windows", "bos", "seconds"):
            if out.get(key) is not None:
                print(f"{key:>11}: {out[key]}")
    return 0
