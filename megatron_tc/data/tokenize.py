"""Tokenize the documents of a split into a TokenStream, cached in the run directory.

The cache is two .npy files (tokens int32, offsets int64) opened memory-mapped, under
`<run_dir>/data_cache/<split>-<key>/`, where the key hashes the tokenizer fingerprint, the EOS id,
the special-token setting, the BOS rule (when on) and the (name, sha256) of every document in order: any change to the
tokenizer or the documents lands in a new directory instead of silently reusing stale tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .documents import DataError, Document, current_umask
from .packing import TokenStream
from .tokenizer import tokenizer_fingerprint

CACHE_DIRNAME = "data_cache"


def tokenize_documents(docs: list[Document], tok: Any, eos_id: int, add_special_tokens: bool = True,
                       batch_size: int = 16, desc: str = "tokenize", bos_id: int | None = None) -> TokenStream:
    """Each document -> its token ids (tokenizer's own special tokens, e.g. BOS, if
    `add_special_tokens`) followed by `eos_id` (unless the tokenizer already ended it with EOS).
    `bos_id` (the BOS rule of megatron_tc.data.bos is on): every document starts with it."""
    token_lists: list[np.ndarray] = []
    bar = tqdm(total=sum(len(d.text) for d in docs), unit="char", unit_scale=True, desc=desc, disable=None)
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        ids = tok([d.text for d in chunk], add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
        for d, seq in zip(chunk, ids):
            token_lists.append(document_ids(seq, eos_id, bos_id))
            bar.update(len(d.text))
    bar.close()
    return TokenStream.from_token_lists(token_lists)


def document_ids(ids: list[int], eos_id: int, bos_id: int | None = None) -> np.ndarray:
    """A document's encoded ids -> its stored tokens int32 [n]: EOS appended unless the tokenizer
    already ended it with EOS; with `bos_id`, BOS prepended unless it already starts with it."""
    seq = list(ids)
    if not seq or seq[-1] != eos_id:
        seq.append(eos_id)
    if bos_id is not None and seq[0] != bos_id:
        seq.insert(0, bos_id)
    return np.asarray(seq, dtype=np.int32)


def cache_key(docs: list[Document], tok_fingerprint: str, eos_id: int, add_special_tokens: bool,
              bos_id: int | None = None) -> str:
    payload = {"tokenizer": tok_fingerprint, "eos": eos_id, "special": add_special_tokens,
               "docs": [(d.name, d.sha256) for d in docs]}
    if bos_id is not None:  # absent without BOS, so caches written before the rule existed still apply
        payload["bos"] = bos_id
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:20]


def cached_token_stream(run_dir: Path | str | None, split: str, docs: list[Document], tok: Any, eos_id: int,
                        add_special_tokens: bool = True, bos_id: int | None = None) -> tuple[TokenStream, str]:
    """(stream, cache key). Loads `<run_dir>/data_cache/<split>-<key>` if present, else tokenizes
    and writes it atomically (tmp dir + rename). run_dir=None: tokenize without caching."""
    if not docs:
        raise DataError(f"the {split} split has no document")
    key = cache_key(docs, tokenizer_fingerprint(tok), eos_id, add_special_tokens, bos_id)
    if run_dir is None:
        return tokenize_documents(docs, tok, eos_id, add_special_tokens, desc=f"tokenize {split}", bos_id=bos_id), key
    target = Path(run_dir) / CACHE_DIRNAME / f"{split}-{key}"
    if (target / "meta.json").is_file():
        return _load(target), key
    stream = tokenize_documents(docs, tok, eos_id, add_special_tokens, desc=f"tokenize {split}", bos_id=bos_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{split}-"))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 directories
    try:
        np.save(tmp / "tokens.npy", stream.tokens)
        np.save(tmp / "offsets.npy", stream.offsets)
        meta = {"split": split, "key": key, "documents": [d.name for d in docs], "tokens": int(len(stream.tokens)),
                "eos_id": eos_id, "add_special_tokens": add_special_tokens, "bos_id": bos_id}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks completeness
        try:
            os.replace(tmp, target)
        except OSError:  # another rank finished first; its copy is identical
            if not (target / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(target), key


def _load(target: Path) -> TokenStream:
    try:
        tokens = np.load(target / "tokens.npy", mmap_mode="r")
        offsets = np.load(target / "offsets.npy")
        return TokenStream(tokens=tokens, offsets=offsets)
    except (OSError, ValueError) as e:
        raise DataError(f"{target}: the tokenized-data cache is unreadable ({e}); delete the directory") from e
