"""Training a small sentencepiece tokenizer for offline runs (the paper grid's teachers, the GPU
smoke teacher), saved as a Hugging Face tokenizer directory."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable


def train_unigram_tokenizer(lines: Iterable[str], out: Path, vocab_size: int, *, input_sentence_size: int = 0,
                            num_threads: int = 1, seed: int = 0) -> None:
    """Unigram sentencepiece with byte fallback (no unknown bytes), <unk>=0 <s>=1 </s>=2, trained on
    `lines` (at most `input_sentence_size` of them, sampled; 0: all) and written to `out` as an HF
    dir. Training samples sentences: the fixed `seed` makes the same lines give the same model."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    # sampling options only when sampling: the trainer spec saved in tokenizer.model lists what was set
    sampling = dict(input_sentence_size=input_sentence_size, shuffle_input_sentence=True) if input_sentence_size else {}
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"),
                                   vocab_size=vocab_size, model_type="unigram", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, byte_fallback=True, minloglevel=2, num_threads=num_threads, **sampling)
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
