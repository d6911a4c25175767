"""Text sources -> documents: the shakespeare corpus, local text / jsonl / parquet files, hub datasets.

jsonl, parquet and hub datasets are read through `datasets.load_dataset`. Plain text files are read
directly: `datasets`' text builder forgets which file a row came from, and document names must be
stable file-relative names for the split manifest; reading the bytes ourselves also lets an
undecodable byte be reported with its file and offset.
"""
from __future__ import annotations

import codecs
import glob
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .corpus import fetch_shakespeare, shakespeare_documents
from .documents import (
    DataError,
    Document,
    OnDecodeError,
    bad_utf8_error,
    check_unique_names,
    decode_utf8,
    normalize_newlines,
)

SourceKind = Literal["shakespeare", "text", "jsonl", "parquet", "hub"]
SplitBy = Literal["file", "paragraph", "line"]


@dataclass
class SourceConfig:
    """Where documents come from.

    kind: shakespeare | text | jsonl | parquet | hub.
    paths: files, directories or glob patterns (text/jsonl/parquet). A directory means every file
        under it with the kind's suffix (.txt; .jsonl/.json; .parquet).
    split_by (text only): one document per file, per blank-line-separated paragraph, or per line.
    text_field / name_field (jsonl, parquet, hub): the column holding the text and, optionally, a
        column with a unique document name (default: `<file>:<row>`).
    on_decode_error: 'error' (name the file and byte offset) or 'replace' (U+FFFD).
    skip_empty: skip empty files instead of refusing them (empty rows/lines are always skipped).
    hub_name / hub_config / hub_split: a Hugging Face hub dataset (needs network).
    cache_dir: the corpus cache (shakespeare) and `datasets` cache (others); None = defaults.
    """

    kind: SourceKind = "shakespeare"
    paths: list[str] = field(default_factory=list)
    split_by: SplitBy = "file"
    text_field: str = "text"
    name_field: str | None = None
    on_decode_error: OnDecodeError = "error"
    skip_empty: bool = False
    include_milton: bool = True
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    cache_dir: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SourceConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise DataError(f"unknown data source keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        cfg = cls(**d)
        if isinstance(cfg.paths, str):
            cfg.paths = [cfg.paths]
        return cfg


_SUFFIXES = {"text": (".txt",), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}


def load_documents(cfg: SourceConfig) -> list[Document]:
    """All documents of a source, in a deterministic order, with unique names."""
    if cfg.kind == "shakespeare":
        docs = shakespeare_documents(fetch_shakespeare(cfg.cache_dir), include_milton=cfg.include_milton)
    elif cfg.kind == "text":
        docs = [d for path, name in resolve_paths(cfg.paths, _SUFFIXES["text"]) for d in _text_file(path, name, cfg)]
    elif cfg.kind in ("jsonl", "parquet"):
        docs = [d for path, name in resolve_paths(cfg.paths, _SUFFIXES[cfg.kind]) for d in _table_file(path, name, cfg)]
    elif cfg.kind == "hub":
        docs = _hub_documents(cfg)
    else:
        raise DataError(f"unknown data source kind {cfg.kind!r}; use one of shakespeare, text, jsonl, parquet, hub")
    if not docs:
        raise DataError(f"the {cfg.kind} source {cfg.paths or cfg.hub_name} holds no non-empty document")
    check_unique_names(docs)
    return docs


def resolve_paths(patterns: list[str], suffixes: tuple[str, ...]) -> list[tuple[Path, str]]:
    """(path, stable name) for every file named by files, directories or globs, sorted per pattern.

    The name is relative to the directory given (or the glob's fixed prefix), so it is the same on
    every machine that holds the data under another root.
    """
    if not patterns:
        raise DataError("no data paths given (set data.source.paths to files, directories or globs)")
    out: list[tuple[Path, str]] = []
    for pattern in patterns:
        p = Path(os.path.expanduser(pattern))
        if glob.has_magic(pattern):
            base = Path(_glob_prefix(os.path.expanduser(pattern)))
            files = sorted(Path(f) for f in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(f).is_file())
            if not files:
                raise DataError(f"the glob {pattern!r} matches no file")
            out += [(f, f.relative_to(base).as_posix()) for f in files]
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
            if not files:
                raise DataError(f"the directory {p} holds no {'/'.join(suffixes)} file")
            out += [(f, f.relative_to(p).as_posix()) for f in files]
        elif p.is_file():
            out.append((p, p.name))
        else:
            raise DataError(f"{pattern}: no such file or directory")
    return out


def _glob_prefix(pattern: str) -> str:
    parts = Path(pattern).parts
    fixed = [q for q in parts[: next(i for i, q in enumerate(parts) if glob.has_magic(q))]]
    return str(Path(*fixed)) if fixed else "."


def _text_file(path: Path, name: str, cfg: SourceConfig) -> list[Document]:
    text = normalize_newlines(decode_utf8(path.read_bytes(), str(path), cfg.on_decode_error))
    if not text.strip():
        if cfg.skip_empty:
            return []
        raise DataError(f"{path}: the file is empty (remove it, or set skip_empty=true)")
    src = str(path)
    if cfg.split_by == "file":
        return [Document(name, text, src)]
    if cfg.split_by == "paragraph":
        pieces = re.split(r"\n\s*\n", text)
        return [Document(f"{name}#p{i}", p.strip(), src) for i, p in enumerate(pieces) if p.strip()]
    if cfg.split_by == "line":
        return [Document(f"{name}#L{i + 1}", line, src) for i, line in enumerate(text.split("\n")) if line.strip()]
    raise DataError(f"split_by must be file, paragraph or line, got {cfg.split_by!r}")


def _table_file(path: Path, name: str, cfg: SourceConfig) -> list[Document]:
    if path.stat().st_size == 0:
        if cfg.skip_empty:
            return []
        raise DataError(f"{path}: the file is empty (remove it, or set skip_empty=true)")
    if cfg.kind == "jsonl" and not _utf8_file_ok(path, cfg.on_decode_error):
        # pyarrow's json reader keeps undecodable bytes (datasets' encoding_errors does not reach
        # it), so 'replace' goes through a repaired temporary copy
        with tempfile.TemporaryDirectory(prefix="megatron_tc_utf8_") as tmp:
            fixed = Path(tmp) / path.name
            fixed.write_bytes(path.read_bytes().decode("utf-8", errors="replace").encode("utf-8"))
            return _table_rows(fixed, name, cfg, where=str(path))
    return _table_rows(path, name, cfg, where=str(path))


def _table_rows(path: Path, name: str, cfg: SourceConfig, where: str) -> list[Document]:
    import datasets

    builder = "json" if cfg.kind == "jsonl" else "parquet"
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cfg.cache_dir)
    except Exception as e:  # datasets/pyarrow raise many types for malformed files
        raise DataError(f"{where}: cannot read as {cfg.kind}: {type(e).__name__}: {e}") from e
    docs = _rows_to_documents(ds, cfg, default_prefix=name, where=where)
    if not docs and not cfg.skip_empty:
        raise DataError(f"{where}: no row has a non-empty {cfg.text_field!r} (set skip_empty=true to allow)")
    return docs


def _utf8_file_ok(path: Path, on_error: OnDecodeError) -> bool:
    """False if the file holds undecodable bytes and on_error='replace'; with 'error' raise naming
    the byte offset of the first one. Streams the file in blocks."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            pending = len(dec.getstate()[0])  # bytes of a split character carried from the last block
            try:
                dec.decode(block)
            except UnicodeDecodeError as e:
                if on_error == "replace":
                    return False
                raise bad_utf8_error(str(path), offset - pending + e.start, e.reason,
                                     e.object[e.start : e.start + 8]) from None
            offset += len(block)
        try:
            dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            if on_error == "replace":
                return False
            raise bad_utf8_error(str(path), offset - len(e.object) + e.start, "truncated at the end of the file",
                                 e.object[e.start :]) from None
    return True


def _rows_to_documents(ds: Any, cfg: SourceConfig, default_prefix: str, where: str) -> list[Document]:
    if cfg.text_field not in ds.column_names:
        raise DataError(f"{where}: no column {cfg.text_field!r} (columns: {ds.column_names}); set text_field")
    if cfg.name_field is not None and cfg.name_field not in ds.column_names:
        raise DataError(f"{where}: no column {cfg.name_field!r} (columns: {ds.column_names}); set name_field")
    texts = ds[cfg.text_field]
    names = ds[cfg.name_field] if cfg.name_field else None
    docs = []
    for i, text in enumerate(texts):
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(f"{where}: row {i}: {cfg.text_field!r} is {type(text).__name__}, not text")
        if text.strip():
            name = str(names[i]) if names is not None else f"{default_prefix}:{i}"
            docs.append(Document(name, normalize_newlines(text), where))
    return docs


def _hub_documents(cfg: SourceConfig) -> list[Document]:
    import datasets

    if not cfg.hub_name:
        raise DataError("kind=hub needs hub_name (e.g. 'wikitext')")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DataError(
            f"the hub dataset {cfg.hub_name!r} needs network access but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE "
            "is set; export it to local jsonl/parquet files and use kind=jsonl or kind=parquet"
        )
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, cache_dir=cfg.cache_dir)
    except Exception as e:
        raise DataError(
            f"cannot load the hub dataset {cfg.hub_name!r} (config {cfg.hub_config}, split {cfg.hub_split}): "
            f"{type(e).__name__}: {e}. Offline? Export it to local jsonl/parquet files and use kind=jsonl/parquet."
        ) from e
    return _rows_to_documents(ds, cfg, default_prefix=f"{cfg.hub_name}:{cfg.hub_split}", where=cfg.hub_name)
