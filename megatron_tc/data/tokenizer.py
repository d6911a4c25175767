"""Tokenizer loading (HF directory, .gguf file, sentencepiece .model) and vocabulary checks.

Everything returns a `transformers` tokenizer, so the rest of the code has one interface:
`tok(texts, add_special_tokens=...)["input_ids"]`, `tok.eos_token_id`, `len(tok)`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .documents import DataError

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer from an HF directory, a directory holding one .gguf, a .gguf file, or a
    sentencepiece .model file.

    transformers 5 cannot build `LlamaTokenizer(vocab_file=...)` from a bare .model, but
    `AutoTokenizer.from_pretrained(folder)` converts a folder's `tokenizer.model`, so a .model file
    with another name is staged as `tokenizer.model` in a temporary folder first.
    """
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"tokenizer {p}: no such file or directory")
    try:
        if p.is_file() and p.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        if p.is_file() and p.suffix == ".model":
            return _load_sentencepiece(p)
        if p.is_dir():
            if any((p / f).is_file() for f in _HF_TOKENIZER_FILES):
                return AutoTokenizer.from_pretrained(str(p))
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return AutoTokenizer.from_pretrained(str(p), gguf_file=ggufs[0].name)
            raise DataError(
                f"tokenizer {p}: the directory holds no tokenizer files ({', '.join(_HF_TOKENIZER_FILES)})"
                + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " and no .gguf file")
            )
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"tokenizer {p}: cannot load: {type(e).__name__}: {e}") from e
    raise DataError(f"tokenizer {p}: expected an HF tokenizer directory, a .gguf file or a sentencepiece .model")


def _load_sentencepiece(model_file: Path) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="megatron_tc_spm_") as tmp:
        shutil.copyfile(model_file, Path(tmp) / "tokenizer.model")
        return AutoTokenizer.from_pretrained(tmp)


def tokenizer_vocab_size(tok: Any) -> int:
    """Number of token ids the tokenizer can emit (base vocabulary plus added tokens)."""
    return len(tok)


def check_vocab_fits(tok: Any, model_vocab_size: int, what: str = "model") -> None:
    """Refuse a tokenizer that can emit ids the model has no embedding row for.

    A model vocabulary larger than the tokenizer's is fine (padding rows, e.g. to a multiple of 128).
    """
    n = tokenizer_vocab_size(tok)
    if n > model_vocab_size:
        raise DataError(
            f"tokenizer/vocabulary mismatch: the tokenizer has {n} tokens but the {what} has only "
            f"{model_vocab_size} embedding rows, so token ids >= {model_vocab_size} would index past "
            f"the embedding. Use the {what}'s own tokenizer (data.tokenizer), or a {what} whose "
            "vocab_size covers this tokenizer."
        )


def check_same_tokenizer(a: Any, b: Any, what_a: str = "teacher", what_b: str = "student") -> None:
    """Refuse two tokenizers that would map text to different ids (teacher vs student vs data)."""
    fa, fb = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    if fa != fb:
        raise DataError(
            f"tokenizer mismatch: the {what_a}'s tokenizer ({len(a)} tokens, fingerprint {fa[:12]}) differs "
            f"from the {what_b}'s ({len(b)} tokens, fingerprint {fb[:12]}); logits and labels would refer to "
            "different tokens. Use one tokenizer for both (the teacher's)."
        )


def check_token_ids_fit(max_token_id: int, model_vocab_size: int, where: str) -> None:
    if max_token_id >= model_vocab_size:
        raise DataError(
            f"{where}: token id {max_token_id} >= vocab size {model_vocab_size}; the data was tokenized "
            "with another tokenizer than the model's (delete the data cache or use the model's tokenizer)"
        )


def tokenizer_fingerprint(tok: Any) -> str:
    """sha256 over the vocabulary and special tokens: equal fingerprints tokenize text identically
    for all practical purposes (used to key the packed-data cache and the manifest's token counts)."""
    backend = getattr(tok, "backend_tokenizer", None)
    payload = {
        # the serialized fast tokenizer covers normalizer, pre-tokenizer, model and merges
        "backend": backend.to_str() if backend is not None else None,
        "vocab": sorted(tok.get_vocab().items(), key=lambda kv: kv[1]),
        "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "eos": tok.eos_token_id,
        "bos": tok.bos_token_id,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def resolve_eos_id(tok: Any, eos_token: str | None = None) -> int:
    """The id appended after every document: `eos_token` if given, else the tokenizer's EOS."""
    if eos_token is not None:
        tid = tok.convert_tokens_to_ids(eos_token)
        if tid is None or (tok.unk_token_id is not None and tid == tok.unk_token_id and eos_token != tok.unk_token):
            raise DataError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        return int(tid)
    if tok.eos_token_id is None:
        raise DataError(
            "the tokenizer has no EOS token, which packing appends after every document; set "
            "data.eos_token to a token of its vocabulary"
        )
    return int(tok.eos_token_id)
