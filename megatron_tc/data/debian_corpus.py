"""A larger corpus of real English prose and reference text from Debian packages: two dictionaries
(GCIDE, from Webster's 1913; WordNet 3.0), two computing dictionaries (FOLDOC, the Jargon File) and
three manuals (the Linux kernel's documentation, Python's, Perl's).

    provenance = write_debian_corpus("corpus/debian")    # DIR/<package>/<document>.txt + PROVENANCE.json

The packages are fetched with `apt-get download` (after `apt-get update`) into a cache, unpacked
with `dpkg-deb -x` and turned into plain-text documents: dictionary entries (dictd `.dict.dz`, in
file order) grouped into documents of about DICT_DOC_CHARS characters; each Sphinx source page
(`_sources/**/*.txt`, reStructuredText) one document; each Perl POD page one document with its
markup stripped; a paragraph that recurs (boilerplate of manual pages) is kept only where it first
occurs, so no paragraph can land in two splits. The result is a `kind: text, split_by: file`
source, split into calibration, training and evaluation documents by the run's manifest. PROVENANCE.json records every package's
version, .deb sha256, licence and document counts; nothing here is committed to the repository.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .documents import DataError, Document, atomic_write_bytes
from .overlap import MIN_PARAGRAPH_CHARS, _BLANK_LINE, normalise_paragraph

DICT_DOC_CHARS = 200_000
MIN_PAGE_CHARS = 1_000
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@dataclass(frozen=True)
class DebianText:
    package: str
    kind: str  # "dictd", "sphinx" or "pod"
    pattern: str  # glob of the text files inside the unpacked package
    licence: str


DEBIAN_TEXTS = (
    DebianText("dict-gcide", "dictd", "usr/share/dictd/gcide.dict.dz", "GPL-2.0-or-later (GCIDE)"),
    DebianText("dict-wn", "dictd", "usr/share/dictd/wn.dict.dz", "WordNet-3.0"),
    DebianText("dict-foldoc", "dictd", "usr/share/dictd/foldoc.dict.dz", "GFDL-1.1-or-later (FOLDOC)"),
    DebianText("dict-jargon", "dictd", "usr/share/dictd/jargon.dict.dz", "public-domain (Jargon File 4.4.7)"),
    DebianText("linux-doc-6.12", "sphinx", "usr/share/doc/linux-doc-6.12/html/_sources/**/*.txt", "GPL-2.0"),
    DebianText("python3.11-doc", "sphinx", "usr/share/doc/python3.11/html/_sources/**/*.txt", "PSF-2.0"),
    DebianText("perl-doc", "pod", "usr/share/perl/*/pod/*.pod", "GPL-1.0-or-later OR Artistic-1.0-Perl"),
)


def _b64_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + _B64.index(char)
    return value


def dictd_entries(dict_path: Path) -> list[str]:
    """The entries of a dictd dictionary (`X.dict.dz` beside `X.index`) in file order, each once,
    without the `00-database-*` metadata entries."""
    index = dict_path.with_name(dict_path.name.removesuffix(".dict.dz") + ".index")
    data = gzip.open(dict_path).read()  # dictzip is gzip with an index in its header
    spans = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        spans.add((_b64_number(parts[1]), _b64_number(parts[2])))
    return [data[start:start + length].decode("utf-8", errors="replace").strip() for start, length in sorted(spans)]


def _chunks(entries: list[str], size: int) -> Iterator[str]:
    part: list[str] = []
    count = 0
    for entry in entries:
        part.append(entry)
        count += len(entry) + 2
        if count >= size:
            yield "\n\n".join(part)
            part, count = [], 0
    if part:
        yield "\n\n".join(part)


_POD_CODE = re.compile(r"[A-Z]<+\s*([^<>]*?)\s*>+")


def pod_to_text(pod: str) -> str:
    """POD without its markup: command paragraphs keep their text (`=head1 NAME` -> `NAME`),
    `=begin`..`=end`, `=for` and `=cut`-type lines go, formatting codes keep their content."""
    out, skipping = [], False
    for line in pod.splitlines():
        if line.startswith("=begin"):
            skipping = True
        elif line.startswith("=end"):
            skipping = False
        elif skipping or line.startswith(("=cut", "=pod", "=for", "=encoding", "=over", "=back")):
            continue
        elif line.startswith("="):
            out.append(line.split(None, 1)[1] if " " in line else "")
        else:
            out.append(line)
    text = "\n".join(out)
    for _ in range(4):  # nested codes, innermost first
        text = _POD_CODE.sub(lambda m: m.group(1).split("|")[0], text)
    return text


def package_documents(root: Path, spec: DebianText) -> list[Document]:
    """Documents of one unpacked package `root` (names `<package>/<...>`)."""
    files = sorted(root.glob(spec.pattern))
    if not files:
        raise DataError(f"{spec.package}: no file matches {spec.pattern} under {root}; the package layout changed")
    docs = []
    if spec.kind == "dictd":
        for path in files:
            for i, text in enumerate(_chunks(dictd_entries(path), DICT_DOC_CHARS)):
                docs.append(Document(f"{spec.package}/{path.name.split('.')[0]}_{i:04d}", text))
        return docs
    prefix = spec.pattern.split("*")[0]
    base = Path(prefix) if prefix.endswith("/") else Path(prefix).parent
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if spec.kind == "pod":
            text = pod_to_text(text)
        if len(text) < MIN_PAGE_CHARS:
            continue
        stem = str(path.relative_to(root / base)).removesuffix(".txt").removesuffix(".rst").removesuffix(".pod")
        docs.append(Document(f"{spec.package}/{stem}", text))
    return docs


def drop_repeated_paragraphs(docs: list[Document], seen: set[str]) -> tuple[list[Document], int]:
    """Each paragraph that `overlap` compares (>= MIN_PARAGRAPH_CHARS normalised characters) kept
    only where it first occurs (`seen` carries over between calls): manuals repeat boilerplate
    ("On error -1 and errno is set..."), which would put one paragraph in two splits."""
    out, dropped = [], 0
    for doc in docs:
        kept = []
        for paragraph in _BLANK_LINE.split(doc.text):
            norm = normalise_paragraph(paragraph)
            if len(norm) >= MIN_PARAGRAPH_CHARS:
                key = hashlib.sha256(norm.encode()).hexdigest()
                if key in seen:
                    dropped += 1
                    continue
                seen.add(key)
            kept.append(paragraph)
        text = "\n\n".join(kept)
        if len(text.strip()) >= MIN_PAGE_CHARS or doc.name.split("/")[0].startswith("dict-"):
            out.append(Document(doc.name, text))
    return out, dropped


def fetch_package(package: str, cache_dir: Path) -> Path:
    """The package's .deb in `cache_dir` (`apt-get download` when absent)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    if shutil.which("apt-get") is None:
        raise DataError(f"{package}: apt-get is not available; fetch the Debian package by hand into {cache_dir}")
    proc = subprocess.run(["apt-get", "download", package], cwd=cache_dir, capture_output=True, text=True)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not have:
        raise DataError(f"apt-get download {package} failed ({proc.stderr.strip()[-300:]}); run `apt-get update` first")
    return have[-1]


def unpack(deb: Path, dest: Path) -> Path:
    if not (dest / ".complete").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
        (dest / ".complete").touch()
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_debian_corpus(out_dir: str | Path, cache_dir: str | Path | None = None,
                        texts: tuple[DebianText, ...] = DEBIAN_TEXTS, progress: bool = False) -> dict:
    """Fetch, unpack and convert every package of `texts`; write OUT/<package>/<doc>.txt and
    OUT/PROVENANCE.json (returned). progress: a bar over the packages (in a terminal)."""
    from megatron_tc.monitor import progress as bar

    out = Path(out_dir)
    cache = Path(cache_dir) if cache_dir else out.parent / (out.name + "_debs")
    provenance = {"source": "Debian packages (apt-get download)", "packages": []}
    seen: set[str] = set()
    for spec in bar(texts, desc="debian packages", unit="package", enabled=progress):
        deb = fetch_package(spec.package, cache)
        root = unpack(deb, cache / "unpacked" / spec.package)
        docs, dropped = drop_repeated_paragraphs(package_documents(root, spec), seen)
        copyright_files = sorted(str(p.relative_to(root)) for p in root.glob("usr/share/doc/*/copyright"))
        for doc in docs:
            atomic_write_bytes(out / f"{doc.name}.txt", doc.text.encode("utf-8"))
        provenance["packages"].append({
            "package": spec.package, "deb": deb.name, "version": deb.name.split("_")[1].replace("%3a", ":"),
            "sha256": _sha256(deb), "bytes": deb.stat().st_size, "licence": spec.licence,
            "copyright": copyright_files, "kind": spec.kind,
            "documents": len(docs), "characters": sum(len(d.text) for d in docs), "repeated_paragraphs_dropped": dropped})
    atomic_write_bytes(out / "PROVENANCE.json", (json.dumps(provenance, indent=1) + "\n").encode())
    return provenance


def corpus_token_counts(corpus_dir: str | Path, tokenizer: str, run_dir: str | Path, calibration_fraction: float = 0.01,
                        eval_fraction: float = 0.01, seed: int = 0) -> dict:
    """Documents and tokens per split of the corpus as a run reads it (manifest in `run_dir`, the
    cached token streams of the data pipeline): {documents: {split: n}, tokens: {split: n}}."""
    from .manifest import SPLITS, SplitConfig
    from .pipeline import DataConfig, prepare_data
    from .sources import SourceConfig

    cfg = DataConfig(source=SourceConfig(kind="text", paths=[str(corpus_dir)], split_by="file"),
                     split=SplitConfig(seed=seed, calibration_fraction=calibration_fraction, eval_fraction=eval_fraction),
                     tokenizer=tokenizer)
    data = prepare_data(cfg, run_dir)
    return {"documents": {s: len(data.documents(s)) for s in SPLITS},
            "tokens": {s: int(len(data.token_stream(s)[0].tokens)) for s in SPLITS}}
