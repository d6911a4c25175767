"""Command line of tools/preprocess.py. Bad input exits with status 2 and a one-line error."""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tokenize a corpus with every core into a memory-mapped token store "
                                            "(megatron-core IndexedDataset: PREFIX.bin / PREFIX.idx)")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (one document per line) or .txt files "
                                                             "(blank-line-separated paragraphs), directories or globs")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory, .gguf or sentencepiece .model "
                                                      "(the teacher's)")
    p.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin, .idx, .docs.tsv, .json)")
    p.add_argument("--threads", type=int, default=None, help="tokenizer threads (default: every core)")
    p.add_argument("--text-key", default="text", help="field holding the text in .jsonl rows")
    p.add_argument("--name-key", default=None, help="field holding a unique document name in .jsonl rows "
                                                    "(default: <file>:<row>)")
    p.add_argument("--eos-token", default=None, help="token appended to every document (default: the tokenizer's EOS)")
    p.add_argument("--no-special-tokens", action="store_true", help="do not add the tokenizer's own special tokens (BOS)")
    p.add_argument("--bos", default="auto", help="every document starts with BOS: auto (when the tokenizer adds "
                                                 "one), true or false; as the run's data.bos")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads {args.threads}: give at least 1", file=sys.stderr)
            return 2
        # read when the tokenizers thread pool starts (RAYON_RS_NUM_CPUS is the older name)
        os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"

    from megatron_tc.data.bos import resolve_bos_id
    from megatron_tc.data.documents import DataError
    from megatron_tc.data.store_inputs import corpus_files, read_named_documents
    from megatron_tc.data.token_store import write_token_store
    from megatron_tc.data.tokenizer import load_tokenizer, resolve_eos_id
    from megatron_tc.monitor import progress

    try:
        files = corpus_files(args.input)
        tok = load_tokenizer(args.tokenizer)
        eos_id = resolve_eos_id(tok, args.eos_token)
        bos_id = resolve_bos_id(tok, args.bos)
        total = sum(path.stat().st_size for path, _ in files)
        start = time.perf_counter()
        with progress(total=total, unit="B", unit_scale=True, desc="tokenize", enabled=not args.no_progress) as bar:
            meta = write_token_store(read_named_documents(files, args.text_key, args.name_key), tok, args.out,
                                     eos_id, add_special_tokens=not args.no_special_tokens, bos_id=bos_id,
                                     progress=bar.update)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {args.out}.bin/.idx: {meta.documents} documents, {meta.tokens} tokens from "
          f"{total / 1e6:.1f} MB in {seconds:.1f} s ({total / 1e6 / seconds:.2f} MB/s)")
    return 0
