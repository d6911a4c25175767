"""Tiny tokenizers and corpora for tests and smoke runs (no network, well under a second).

`train_tiny_tokenizer(dir)` trains a sentencepiece unigram model on generated pseudo-English and
saves it as an HF tokenizer directory (`AutoTokenizer.from_pretrained(dir)` works), so a tiny
random model with `vocab_size >= len(tokenizer)` runs the real data path end to end.
"""
from __future__ import annotations

import random
import string
from pathlib import Path

from .documents import atomic_write_bytes


def synthetic_words(n: int, seed: int = 0, alphabet: str = string.ascii_lowercase) -> list[str]:
    """Pseudo-words with a Zipf-like reuse pattern, so a tokenizer learns multi-letter pieces."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    return rng.choices(lexicon, weights=weights, k=n)


def synthetic_text(n_words: int, seed: int = 0) -> str:
    words = synthetic_words(n_words, seed)
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return "\n".join(line.capitalize() + "." for line in lines) + "\n"


def train_tiny_tokenizer(out_dir: Path | str, vocab_size: int = 320, seed: int = 0) -> Path:
    """Train a sentencepiece model (ids: 0 <unk>, 1 <s>, 2 </s>, byte fallback) into `out_dir`
    as `tokenizer.model` plus the HF files; returns `out_dir`."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = synthetic_text(3000, seed).splitlines()
    spm.set_random_generator_seed(seed)  # training samples sentences; fixed seed = same model
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size,
        model_type="unigram", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        minloglevel=2, num_threads=1,
    )
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
    return out


def write_synthetic_corpus(out_dir: Path | str, n_docs: int = 12, words_per_doc: tuple[int, int] = (20, 400),
                           seed: int = 0) -> list[Path]:
    """`n_docs` text files of varying length (doc_000.txt, ...) for a kind=text source."""
    rng = random.Random(seed)
    paths = []
    for i in range(n_docs):
        p = Path(out_dir) / f"doc_{i:03d}.txt"
        atomic_write_bytes(p, synthetic_text(rng.randint(*words_per_doc), seed=seed * 1000 + i).encode())
        paths.append(p)
    return paths
