"""Tiny offline models and tokenizers for tests and smoke runs (nothing is downloaded).

A word-level tokenizer over a given word list (whitespace split, so token boundaries are exact and
easy to reason about in tests) and a tiny random `LlamaForCausalLM`, both saved as a normal HF
directory that `load_model` and lm-evaluation-harness read like any exported student.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

SPECIAL_TOKENS = ("<unk>", "<eos>")


def word_tokenizer(words: Iterable[str]):
    """PreTrainedTokenizerFast with ids: <unk>=0, <eos>=1 (also bos/pad), then `words` in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        if any(c.isspace() for c in w) or not w:
            raise ValueError(f"word {w!r} is empty or contains whitespace")
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                   bos_token="<eos>", pad_token="<eos>")


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, max_positions: int = 4096):
    """A random LlamaForCausalLM small enough for unit tests (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def save_hf(directory: str | os.PathLike, model, tokenizer) -> str:
    """Save model + tokenizer as an HF directory; returns the path."""
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
