"""Training a small sentencepiece tokenizer for offline runs (the paper grid's teachers, the GPU
smoke teacher), saved as a Hugging Face tokenizer directory."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable


def train_unigram_tokenizer(lines: Iterable[str], out: Path, vocab_size: int, *, input_sentence_size: int,
                            num_threads: int) -> None:
    """Unigram sentencepiece with byte fallback (no unknown bytes), <unk>=0 <s>=1 </s>=2, trained on
    `lines` (seeded: the same lines give the same tokenizer) and written to `out` as an HF dir."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"),
                                   vocab_size=vocab_size, model_type="unigram", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, byte_fallback=True, minloglevel=2, num_threads=num_threads,
                                   input_sentence_size=input_sentence_size, shuffle_input_sentence=True)
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
