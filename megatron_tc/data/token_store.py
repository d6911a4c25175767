"""A corpus tokenized once, with every core, into megatron-core's IndexedDataset files
(`<prefix>.bin`: the int32 token ids of every document back to back; `<prefix>.idx`: lengths and
pointers), and opened again as a memory-mapped `TokenStream`.

Why IndexedDataset rather than Arrow: the .bin file *is* the token stream `packing.py` works on
(documents, each followed by EOS, concatenated), so `np.memmap` gives the stream without a copy
and `PackedSequences` / `DistributedBatchLoader` run on it unchanged (same windows, labels,
document ids and positions; the order a pure function of seed and step, so runs resume). Megatron-
LM and NeMo read the same files. Arrow would store one list per document and need the
concatenation rebuilt.

Tokenization follows `tokenize.tokenize_documents` exactly (the tokenizer's special tokens, then
EOS unless the tokenizer already ended the document with it); documents go to a pool of worker
processes in bounded windows, so memory does not grow with the corpus.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .documents import DataError, Document
from .packing import TokenStream

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, eos_id: int, add_special_tokens: bool) -> None:
    from .tokenizer import load_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tok=load_tokenizer(tokenizer_path), eos_id=eos_id, special=add_special_tokens)


def _tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from .tokenize import tokenize_documents

    docs = [Document(name=str(i), text=t) for i, t in enumerate(texts)]
    stream = tokenize_documents(docs, _WORKER["tok"], _WORKER["eos_id"], _WORKER["special"])
    return stream.tokens, stream.doc_lengths()


def write_token_store(texts: Iterable[str], tokenizer_path: str | Path, prefix: str | Path, eos_id: int,
                      add_special_tokens: bool = True, workers: int | None = None, chunk_docs: int = 256,
                      progress: Any = None) -> dict[str, int]:
    """Tokenize `texts` (one document each) into `<prefix>.bin` / `<prefix>.idx`; returns counts.

    `workers` processes (default: every core) each hold the tokenizer; at most 4 chunks per
    worker are in flight. `progress(chars)` is called as chunks are written."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    chunks = _chunks(texts, chunk_docs)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    counts = {"documents": 0, "tokens": 0, "chars": 0}
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (tokenizers, torch)
    with ctx.Pool(workers, _init_worker, (str(tokenizer_path), eos_id, add_special_tokens)) as pool:
        while window := list(itertools.islice(chunks, 4 * workers)):
            for texts_in, (tokens, lengths) in zip(window, pool.imap(_tokenize_chunk, window)):
                start = 0
                for n in lengths.tolist():
                    builder.add_document(tokens[start:start + n], [n])
                    start += n
                counts["documents"] += len(lengths)
                counts["tokens"] += len(tokens)
                chars = sum(len(t) for t in texts_in)
                counts["chars"] += chars
                if progress is not None:
                    progress(chars)
    if counts["documents"] == 0:
        builder.data_file.close()
        raise DataError("the corpus holds no documents")
    builder.finalize(str(prefix) + ".idx")
    return counts


def _chunks(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def open_token_store(prefix: str | Path) -> TokenStream:
    """The store as a `TokenStream`: tokens memory-mapped from `<prefix>.bin` (read on demand),
    document offsets (8 bytes per document) from the index."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = Path(prefix)
    for suffix in (".bin", ".idx"):
        if not Path(str(prefix) + suffix).is_file():
            raise DataError(f"token store {prefix}: {prefix}{suffix} is missing; write it with tools/preprocess.py")
    index = IndexedDataset(str(prefix), mmap=True)
    if index.index.dtype != np.int32:
        raise DataError(f"token store {prefix}: token dtype {index.index.dtype.__name__}, expected int32")
    lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.memmap(str(prefix) + ".bin", dtype=np.int32, mode="r")
    if len(tokens) != offsets[-1]:
        raise DataError(f"token store {prefix}: {prefix}.bin holds {len(tokens)} tokens, the index says {offsets[-1]}")
    return TokenStream(tokens=tokens, offsets=offsets)


def read_documents(paths: list[Path], text_key: str = "text") -> Iterator[str]:
    """Documents of .jsonl files (one JSON object per line, its `text_key`) or .txt files
    (documents separated by blank lines), streamed line by line."""
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        row = json.loads(line)
                        if text_key not in row:
                            raise DataError(f"{path}:{number}: no {text_key!r} field (pass --text-key)")
                        yield row[text_key]
        elif path.suffix == ".txt":
            with open(path, encoding="utf-8") as handle:
                lines: list[str] = []
                for line in handle:
                    if line.strip():
                        lines.append(line)
                    elif lines:
                        yield "".join(lines).rstrip("\n")
                        lines = []
                if lines:
                    yield "".join(lines).rstrip("\n")
        else:
            raise DataError(f"{path}: expected a .jsonl or .txt file")
