"""Documents of a corpus for the token store, streamed file by file and named as the run
config's text sources name them, so a store and `data.source` split the same corpus identically.

* `.jsonl` / `.json`: one JSON object per line (blank lines skipped); rows without text are
  skipped but keep their row number. Named `<file>:<row>` or by `name_key`, as a `kind: jsonl`
  source names them.
* `.txt`: documents are blank-line-separated paragraphs, stripped, named `<file>#p<i>`, as a
  `kind: text, split_by: paragraph` source (`re.split(r"\\n\\s*\\n", text)`) numbers them; read
  line by line, never whole.

File names follow `sources.resolve_paths` (relative to the directory or glob given).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .documents import DataError, normalize_newlines
from .sources import resolve_paths

_SUFFIXES = (".jsonl", ".json", ".txt")


def corpus_files(patterns: list[str]) -> list[tuple[Path, str]]:
    """(path, document-name prefix) of every input file; directories mean their .jsonl/.json/.txt files."""
    files = resolve_paths(patterns, _SUFFIXES)
    bad = [str(p) for p, _ in files if not p.name.endswith(_SUFFIXES)]
    if bad:
        raise DataError(f"input {bad[0]}: expected a .jsonl, .json or .txt file")
    return files


def read_named_documents(files: list[tuple[Path, str]], text_key: str = "text",
                         name_key: str | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of every non-empty document of the files, in order."""
    for path, prefix in files:
        if path.suffix == ".txt":
            yield from _paragraphs(path, prefix)
        else:
            yield from _rows(path, prefix, text_key, name_key)


def _rows(path: Path, prefix: str, text_key: str, name_key: str | None) -> Iterator[tuple[str, str]]:
    row = 0
    with open(path, encoding="utf-8-sig") as handle:
        for number, line in enumerate(_lines(handle, path), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if text_key not in record:
                raise DataError(f"{path}:{number}: no {text_key!r} field (pass --text-key)")
            if name_key is not None and name_key not in record:
                raise DataError(f"{path}:{number}: no {name_key!r} field (pass --name-key)")
            text = record[text_key]
            if isinstance(text, str) and text.strip():
                yield (str(record[name_key]) if name_key else f"{prefix}:{row}"), normalize_newlines(text)
            elif text is not None and not isinstance(text, str):
                raise DataError(f"{path}:{number}: {text_key!r} is {type(text).__name__}, not text")
            row += 1


def _paragraphs(path: Path, prefix: str) -> Iterator[tuple[str, str]]:
    """The pieces of `re.split(r"\\n\\s*\\n", text)`, streamed: a run of whitespace-only lines
    separates two pieces when a line follows it; a run that ends the file separates only its last
    line (the regex needs a newline after the run)."""
    index, piece, blank = 0, [], []  # blank: whitespace-only lines after the piece's last line
    with open(path, encoding="utf-8-sig") as handle:
        for line in _lines(handle, path):
            line = line[:-1] if line.endswith("\n") else line
            if not piece:
                piece.append(line)
            elif line.strip():
                if blank:
                    yield from _piece(prefix, index, piece)
                    index, piece, blank = index + 1, [line], []
                else:
                    piece.append(line)
            else:
                blank.append(line)
    if piece:
        yield from _piece(prefix, index, piece)  # a last piece of one whitespace line is empty


def _piece(prefix: str, index: int, lines: list[str]) -> Iterator[tuple[str, str]]:
    text = "\n".join(lines).strip()
    if text:
        yield f"{prefix}#p{index}", text


def _lines(handle, path: Path) -> Iterator[str]:
    """Lines of a text-mode file (universal newlines: \\r\\n and \\r read as \\n); bad UTF-8 is an error."""
    try:
        yield from handle
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: invalid UTF-8 ({e.reason}); convert the file to UTF-8 "
                        "(e.g. `iconv -f latin1 -t utf-8`)") from None
