"""Tiny tokenizers and corpora for tests and smoke runs (no network, well under a second).

Family-shaped tokenizers (Gemma-3, Llama-3, SmolLM2, a GGUF file) reproduce how each adds BOS.

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
    from megatron_tc.data.tokenizer_training import train_unigram_tokenizer

    out = Path(out_dir)
    train_unigram_tokenizer(synthetic_text(3000, seed).splitlines(), out, vocab_size, seed=seed)
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


# ---- tiny tokenizers shaped like real families' (for the BOS rule; character-level, no merges) -----

_CHARS = string.ascii_letters + string.digits + ".,;:!?'-\n"


def gemma3_style_tokenizer():
    """A `GemmaTokenizer` like Gemma-3's: <pad>=0 <eos>=1 <bos>=2, sentencepiece-style pieces, and
    `add_bos_token=True` (Gemma's tokenizer_config), so encoded text starts with <bos>."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"))}
    for c in _CHARS:
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)


def byte_level_tokenizer(bos_token: str, eos_token: str, adds_bos: bool):
    """A byte-level BPE tokenizer (256 byte tokens, then BOS and EOS). `adds_bos=True` is Llama-3's
    shape: the post-processor prepends BOS while `add_bos_token` is not set; False is SmolLM2's /
    GPT-2's: a BOS token exists but encoding never adds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    bos_id, eos_id = len(vocab), len(vocab) + 1
    vocab.update({bos_token: bos_id, eos_token: eos_id})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    steps = [processors.ByteLevel(trim_offsets=False)]
    if adds_bos:
        steps.append(processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1",
                                                   special_tokens=[(bos_token, bos_id)]))
    backend.post_processor = processors.Sequence(steps)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos_token, eos_token=eos_token)


def llama3_style_tokenizer():
    return byte_level_tokenizer("<|begin_of_text|>", "<|end_of_text|>", adds_bos=True)


def smollm2_style_tokenizer():
    return byte_level_tokenizer("<|im_start|>", "<|endoftext|>", adds_bos=False)


def write_gguf_tokenizer(path: Path | str, add_bos: bool) -> Path:
    """A .gguf file holding only a tiny sentencepiece ('llama') tokenizer whose
    `tokenizer.ggml.add_bos_token` is `add_bos` (<unk>=0 <s>=1 </s>=2), plus one embedding tensor."""
    import gguf
    import numpy as np

    tokens = ["<unk>", "<s>", "</s>", "\u2581"] + list(_CHARS.replace("\n", ""))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))  # unknown, control x2, normal
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
