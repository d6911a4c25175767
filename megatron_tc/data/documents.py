"""Documents, the unit that splits and packing work on, and the checks every text source shares.

A document is one coherent text (a play, a file, a jsonl row) with a *stable name*: the split
manifest assigns documents to calibration / train / eval by name and records the sha256 of each
text, so names must not depend on the machine (no absolute paths) or on load order.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

OnDecodeError = Literal["error", "replace"]


class DataError(ValueError):
    """Bad data input (missing/empty file, undecodable bytes, split or manifest mismatch)."""


@dataclass(frozen=True)
class Document:
    """One text. `name` is stable across machines and runs; `source` says where it came from."""

    name: str
    text: str
    source: str = ""

    @property
    def sha256(self) -> str:
        return text_sha256(self.text)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def decode_utf8(data: bytes, where: str, on_error: OnDecodeError = "error") -> str:
    """Decode UTF-8 (a leading BOM is dropped). On bad bytes: raise naming `where` and the byte
    offset, or replace them with U+FFFD when `on_error="replace"`."""
    if on_error not in ("error", "replace"):
        raise DataError(f"on_decode_error must be 'error' or 'replace', got {on_error!r}")
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return codecs.decode(data[skip:], "utf-8", errors="strict")
    except UnicodeDecodeError as e:
        if on_error == "replace":
            return codecs.decode(data[skip:], "utf-8", errors="replace")
        start = skip + e.start
        raise bad_utf8_error(where, start, e.reason, data[start : start + 8]) from None


def bad_utf8_error(where: str, offset: int, reason: str, bad: bytes) -> DataError:
    return DataError(
        f"{where}: invalid UTF-8 at byte offset {offset} ({reason}; bytes {bad!r}). "
        "Convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or set "
        "on_decode_error='replace' to replace undecodable bytes with U+FFFD."
    )


def read_text_file(path: Path, on_error: OnDecodeError = "error") -> str:
    """Read a whole file as UTF-8; missing files and undecodable bytes raise DataError."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return decode_utf8(path.read_bytes(), str(path), on_error)


def normalize_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only the text between Project Gutenberg's START/END markers when they are present
    (the license header and footer say nothing about the work and would repeat across documents)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip() + "\n"


def check_unique_names(docs: list[Document]) -> None:
    seen: dict[str, str] = {}
    for d in docs:
        if d.name in seen:
            raise DataError(
                f"two documents are named {d.name!r} ({seen[d.name]} and {d.source}); document "
                "names must be unique because the split manifest assigns documents by name"
            )
        seen[d.name] = d.source


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600 files; others may read runs
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
