"""Command line of tools/preprocess.py. Bad input exits with status 2 and a one-line error."""
from __future__ import annotations

import argparse
import glob
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tokenize a corpus with every core into a memory-mapped token store "
                                            "(megatron-core IndexedDataset: PREFIX.bin / PREFIX.idx)")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (one document per line) or .txt files "
                                                             "(documents separated by blank lines); globs allowed")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory, .gguf or sentencepiece .model")
    p.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core)")
    p.add_argument("--text-key", default="text", help="field holding the text in .jsonl rows")
    p.add_argument("--eos-token", default=None, help="token appended to every document (default: the tokenizer's EOS)")
    p.add_argument("--no-special-tokens", action="store_true", help="do not add the tokenizer's own special tokens (BOS)")
    args = p.parse_args(argv)

    from tqdm.auto import tqdm

    from megatron_tc.data.documents import DataError
    from megatron_tc.data.token_store import read_documents, write_token_store
    from megatron_tc.data.tokenizer import load_tokenizer, resolve_eos_id

    try:
        paths = sorted({Path(m) for pattern in args.input for m in (glob.glob(pattern) or [pattern])})
        missing = [str(q) for q in paths if not q.is_file()]
        if missing:
            raise DataError(f"input {missing[0]}: no such file")
        eos_id = resolve_eos_id(load_tokenizer(args.tokenizer), args.eos_token)
        total = sum(q.stat().st_size for q in paths)
        start = time.perf_counter()
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize") as bar:  # chars ~ bytes
            counts = write_token_store(read_documents(paths, args.text_key), args.tokenizer, args.out, eos_id,
                                       add_special_tokens=not args.no_special_tokens, workers=args.workers,
                                       progress=bar.update)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {args.out}.bin/.idx: {counts['documents']} documents, {counts['tokens']} tokens from "
          f"{total / 1e6:.1f} MB in {seconds:.1f} s ({total / 1e6 / seconds:.2f} MB/s)")
    return 0
