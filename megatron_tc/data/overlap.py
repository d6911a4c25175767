"""Text overlap by normalised-paragraph hashes: calibration text must share nothing with the
evaluation text (a student calibrated on the text it is scored on looks better than it is).

    record = text_record("calib.txt")          # {path, sha256, paragraphs, paragraph_hashes}
    check_disjoint(record, text_record("eval.txt"))   # OverlapError naming both files

A paragraph is a run of text between blank lines, normalised (Unicode NFKC, case-folded,
whitespace collapsed, so re-wrapped or re-indented copies match). Paragraphs shorter than
MIN_PARAGRAPH_CHARS normalised characters are ignored: headings such as "CHAPTER I" recur in
unrelated books.
"""
from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable

from .documents import DataError

MIN_PARAGRAPH_CHARS = 64
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_SPACE = re.compile(r"\s+")


class OverlapError(DataError):
    """Calibration text that shares paragraphs with the evaluation text."""


def normalise_paragraph(paragraph: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", paragraph).casefold()).strip()


def paragraphs(text: str) -> list[str]:
    """The runs of `text` between blank lines, as they are (not normalised)."""
    return _BLANK_LINE.split(text.replace("\r\n", "\n"))


def paragraph_hashes(text: str) -> set[str]:
    """sha256 (first 16 hex digits) of every normalised paragraph of >= MIN_PARAGRAPH_CHARS characters."""
    out = set()
    for paragraph in paragraphs(text):
        norm = normalise_paragraph(paragraph)
        if len(norm) >= MIN_PARAGRAPH_CHARS:
            out.add(hashlib.sha256(norm.encode()).hexdigest()[:16])
    return out


def text_record(path: str | os.PathLike) -> dict:
    """What a statistics file records about the text it was computed on."""
    data = open(path, "rb").read()
    hashes = paragraph_hashes(data.decode("utf-8", errors="replace"))
    return {"path": os.path.abspath(path), "sha256": hashlib.sha256(data).hexdigest(),
            "paragraphs": len(hashes), "paragraph_hashes": sorted(hashes)}


def documents_record(label: str, texts: Iterable[str]) -> dict:
    """`text_record` of documents (e.g. a token store's calibration split, decoded): the union of
    each document's paragraph hashes (a paragraph never spans two documents); `sha256` of the
    texts joined by blank lines; `path` the label that names them in errors."""
    hashes: set[str] = set()
    digest = hashlib.sha256()
    for i, text in enumerate(texts):
        hashes |= paragraph_hashes(text)
        digest.update((b"\n\n" if i else b"") + text.encode("utf-8"))
    return {"path": label, "sha256": digest.hexdigest(), "paragraphs": len(hashes),
            "paragraph_hashes": sorted(hashes)}


def check_disjoint(calibration: dict, evaluation: dict) -> None:
    """Raise OverlapError when the two `text_record`s share a paragraph (or are the same bytes)."""
    shared = set(calibration["paragraph_hashes"]) & set(evaluation["paragraph_hashes"])
    if shared or calibration["sha256"] == evaluation["sha256"]:
        raise OverlapError(
            f"calibration text {calibration['path']} shares {len(shared) or 'all'} paragraph(s) with evaluation text "
            f"{evaluation['path']}: calibrating on evaluation text flatters every number; use texts that share no "
            "paragraph (e.g. different documents of one corpus, split by its manifest)")
