"""The Debian corpus: dictd entries read through their index, POD stripped of markup, documents
named per package, and a real .deb (built here with dpkg-deb) unpacked into documents."""
from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import sys

import pytest

from megatron_tc.data.debian_corpus import (
    _B64, DebianText, dictd_entries, package_documents, pod_to_text, write_debian_corpus,
)


def _b64(n: int) -> str:
    out = ""
    while True:
        out = _B64[n % 64] + out
        n //= 64
        if n == 0:
            return out


def _write_dictd(directory, name, entries):
    """A dictd dictionary: entries concatenated in .dict.dz, `word<TAB>offset<TAB>length` in .index
    (base-64 numbers), two headwords pointing at the first entry, and a metadata entry."""
    directory.mkdir(parents=True, exist_ok=True)
    blob, lines, offset = b"", [], 0
    for word, text in [("00-database-info", "made by a test")] + entries:
        data = (text + "\n").encode()
        lines.append(f"{word}\t{_b64(offset)}\t{_b64(len(data))}")
        blob, offset = blob + data, offset + len(data)
    lines.append(f"alias\t{_b64(len(b'made by a test') + 1)}\t{_b64(len(entries[0][1]) + 1)}")
    (directory / f"{name}.index").write_text("\n".join(sorted(lines)) + "\n")
    with gzip.open(directory / f"{name}.dict.dz", "wb") as f:
        f.write(blob)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_dictd_entries_in_file_order_once_without_metadata(tmp_path):
    entries = [("zebra", "zebra\n   n. A striped horse."), ("apple", "apple\n   n. A fruit; \u00e9tude.")]
    _write_dictd(tmp_path, "toy", entries)
    assert dictd_entries(tmp_path / "toy.dict.dz") == [text for _, text in entries]


def test_pod_to_text():
    pod = "=head1 NAME\n\nperlfoo - B<bold> and C<< code >> and L<perlvar|perlvar/$_>\n\n=begin html\n\n<b>x</b>\n\n=end html\n\n=cut\n"
    assert pod_to_text(pod).split() == ["NAME", "perlfoo", "-", "bold", "and", "code", "and", "perlvar"]


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_a_built_package_becomes_documents_with_provenance(tmp_path, monkeypatch):
    tree = tmp_path / "pkg"
    _write_dictd(tree / "usr/share/dictd", "toy", [(f"w{i}", f"w{i}\n   " + "word " * 40) for i in range(30)])
    page = tree / "usr/share/doc/toy/html/_sources/guide/intro.rst.txt"
    page.parent.mkdir(parents=True)
    page.write_text("Introduction\n============\n\n" + "A sentence of the manual. " * 60)
    (tree / "usr/share/doc/toy/copyright").write_text("License: public-domain\n")
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN/control").write_text("Package: toy-doc\nVersion: 1.0-1\nArchitecture: all\n"
                                         "Maintainer: t <t@example.org>\nDescription: toy\n")
    cache = tmp_path / "debs"
    cache.mkdir()
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(tree), str(cache / "toy-doc_1.0-1_all.deb")],
                   check=True, capture_output=True)
    texts = (DebianText("toy-doc", "dictd", "usr/share/dictd/toy.dict.dz", "public-domain"),)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    prov = write_debian_corpus(tmp_path / "corpus", cache, texts, progress=True)
    assert "debian packages: 100%" in terminal.getvalue() and "1/1" in terminal.getvalue()
    (entry,) = prov["packages"]
    assert entry["version"] == "1.0-1" and entry["copyright"] == ["usr/share/doc/toy/copyright"]
    assert len(entry["sha256"]) == 64 and entry["documents"] == 1
    assert json.loads((tmp_path / "corpus/PROVENANCE.json").read_text()) == prov
    assert (tmp_path / "corpus/toy-doc/toy_0000.txt").read_text().startswith("w0\n")
    sphinx = DebianText("toy-doc", "sphinx", "usr/share/doc/toy/html/_sources/**/*.txt", "public-domain")
    (doc,) = package_documents(cache / "unpacked" / "toy-doc", sphinx)
    assert doc.name == "toy-doc/guide/intro" and doc.text.startswith("Introduction")


def test_repeated_paragraphs_are_kept_only_where_they_first_occur():
    from megatron_tc.data.debian_corpus import drop_repeated_paragraphs
    from megatron_tc.data.documents import Document
    from megatron_tc.data.overlap import paragraph_hashes

    boiler = "On error -1 is returned and the errno variable is set appropriately by the call."
    a = Document("dict-x/a", f"{boiler}\n\nFirst page's own paragraph, long enough to be compared with others.")
    b = Document("dict-x/b", f"Second page's own paragraph, also long enough to be compared.\n\n{boiler.upper()}")
    seen: set[str] = set()
    (first,), dropped_a = drop_repeated_paragraphs([a], seen)
    (second,), dropped_b = drop_repeated_paragraphs([b], seen)
    assert (dropped_a, dropped_b) == (0, 1) and first.text == a.text
    assert not paragraph_hashes(first.text) & paragraph_hashes(second.text)


def test_count_tokens_without_the_debian_corpus_is_refused(capsys):
    from megatron_tc.data.fetch_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--count-tokens", "some-tokenizer"])
    assert exit_info.value.code == 2
    assert "--count-tokens counts the Debian corpus's tokens: give --debian DIR with it" in capsys.readouterr().err
