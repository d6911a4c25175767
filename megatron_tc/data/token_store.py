"""A corpus tokenized once into megatron-core's IndexedDataset files, and opened again as a
memory-mapped `TokenStream`.

Files of a store `PREFIX`:

* `PREFIX.bin`: the int32 token ids of every document back to back (each followed by EOS);
* `PREFIX.idx`: megatron-core's index (document lengths and byte pointers);
* `PREFIX.docs.tsv`: one line per document, `<first 16 hex digits of the text's sha256>\\t<name>`,
  what the run's split and duplicate check need without the text;
* `PREFIX.json`: how it was tokenized (tokenizer fingerprint, EOS and BOS ids, special tokens) and
  the totals; written last, so its presence marks a complete store.

Why IndexedDataset rather than Arrow: the .bin file *is* the token stream `packing.py` works on,
so `np.memmap` gives the stream without a copy and `PackedSequences` / `DistributedBatchLoader`
run on it unchanged. Megatron-LM and NeMo read the same files. Arrow would store one list per
document and need the concatenation rebuilt.

Tokenization follows `tokenize.tokenize_documents` exactly (`tokenize.document_ids`). A fast
tokenizer encodes each chunk of documents with `tokenizers`' `encode_batch_fast`, which releases
the GIL and runs on its own thread pool over every core, while a reader thread parses the next
chunk: one process, one tokenizer in memory, at most four chunks of text in flight.
"""
from __future__ import annotations

import hashlib
import json
import queue
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .documents import DataError
from .packing import TokenStream
from .tokenize import document_ids

STORE_FORMAT = "megatron_tc.token_store"
CHUNK_CHARS = 1 << 21


@dataclass
class StoreMeta:
    """What `PREFIX.json` records: the tokenization (checked against a run's tokenizer) and totals."""

    tokenizer_fingerprint: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    add_special_tokens: bool
    documents: int
    tokens: int
    chars: int
    max_token_id: int
    format: str = STORE_FORMAT
    version: int = 1

    @classmethod
    def load(cls, prefix: str | Path) -> "StoreMeta":
        path = Path(f"{prefix}.json")
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"token store {prefix}: cannot read {path} ({e}); write the store with "
                            "tools/preprocess.py (an interrupted run leaves no .json)") from None
        if d.get("format") != STORE_FORMAT:
            raise DataError(f"token store {prefix}: {path} is not a megatron_tc token store record")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def batch_encoder(tok: Any, add_special_tokens: bool, probe: list[str]) -> Callable[[list[str]], list[list[int]]]:
    """texts -> ids per text, as `tok(texts, add_special_tokens=...)["input_ids"]` gives them: the
    fast tokenizer's own batch encoding when it gives the same ids on `probe`, else `tok` itself."""
    def through_transformers(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]

    backend = getattr(tok, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if encode is None:
        return through_transformers

    def fast(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]

    if probe and [list(x) for x in fast(probe)] != [list(x) for x in through_transformers(probe)]:
        print("warning: the fast tokenizer's batch encoding differs from the tokenizer's own call here; "
              "using the slower call", file=sys.stderr)
        return through_transformers
    return fast


def write_token_store(docs: Iterable[tuple[str, str]], tok: Any, prefix: str | Path, eos_id: int,
                      add_special_tokens: bool = True, bos_id: int | None = None, chunk_chars: int = CHUNK_CHARS,
                      progress: Callable[[int], Any] | None = None) -> StoreMeta:
    """Tokenize `(name, text)` documents into the store `prefix` (files above); returns its record.
    `progress(chars)` is called as chunks are written."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from .tokenizer import tokenizer_fingerprint

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").unlink(missing_ok=True)  # the store is incomplete until it is rewritten
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    counts = {"documents": 0, "tokens": 0, "chars": 0, "max_token_id": -1}
    encode = None
    with open(f"{prefix}.docs.tsv", "w", encoding="utf-8") as names:
        for chunk in _prefetched(_chunks(docs, chunk_chars)):
            texts = [t for _, t in chunk]
            encode = encode or batch_encoder(tok, add_special_tokens, texts[:64])
            for (name, text), ids in zip(chunk, encode(texts)):
                tokens = document_ids(ids, eos_id, bos_id)
                builder.add_document(tokens, [len(tokens)])
                names.write(f"{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}\t{name}\n")
                counts["tokens"] += len(tokens)
                counts["max_token_id"] = max(counts["max_token_id"], int(tokens.max()))
            chars = sum(len(t) for t in texts)
            counts["documents"] += len(chunk)
            counts["chars"] += chars
            if progress is not None:
                progress(chars)
    if counts["documents"] == 0:
        builder.data_file.close()
        raise DataError("the corpus holds no documents")
    builder.finalize(f"{prefix}.idx")
    meta = StoreMeta(tokenizer_fingerprint=tokenizer_fingerprint(tok), vocab_size=len(tok), eos_id=eos_id,
                     bos_id=bos_id, add_special_tokens=add_special_tokens, **counts)
    Path(f"{prefix}.json").write_text(json.dumps(asdict(meta), indent=1) + "\n")
    return meta


def _chunks(docs: Iterable[tuple[str, str]], chars: int) -> Iterator[list[tuple[str, str]]]:
    """Documents grouped into chunks of about `chars` characters; names must fit one .tsv field."""
    chunk, size = [], 0
    for name, text in docs:
        if "\t" in name or "\n" in name:
            raise DataError(f"document name {name!r} holds a tab or newline; names must be single-line text")
        chunk.append((name, text))
        size += len(text)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _prefetched(chunks: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """`chunks`, read ahead by a thread (at most `depth` waiting); its errors re-raised here."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def read() -> None:
        try:
            for item in chunks:
                while not stop.is_set():
                    try:
                        slots.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put(done)
        except BaseException as e:  # handed to the consumer
            slots.put(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while (item := slots.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join(timeout=5)


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
