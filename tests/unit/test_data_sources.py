"""Text sources: local text/jsonl/parquet through stable document names, and clear errors on
missing, empty and non-UTF-8 input."""
import json

import pytest

from megatron_tc.data import DataError, SourceConfig, load_documents


def _load(tmp_path, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "hf_cache"))
    return load_documents(SourceConfig(**kw))


def test_text_directory_one_document_per_file(tmp_path):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "b.txt").write_text("second\r\nline\n")
    (tmp_path / "data" / "sub" / "a.txt").write_text("\ufefffirst")
    (tmp_path / "data" / "skip.md").write_text("not a .txt")
    docs = _load(tmp_path, kind="text", paths=[str(tmp_path / "data")])
    assert [(d.name, d.text) for d in docs] == [("b.txt", "second\nline\n"), ("sub/a.txt", "first")]
    globbed = _load(tmp_path, kind="text", paths=[str(tmp_path / "data" / "**" / "*.txt")])
    assert sorted(d.name for d in globbed) == ["b.txt", "sub/a.txt"]


def test_text_split_by_paragraph_and_line(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("p one\nstill one\n\n\n  \np two\n\np three")
    paras = _load(tmp_path, kind="text", paths=[str(f)], split_by="paragraph")
    assert [(d.name, d.text) for d in paras] == [("t.txt#p0", "p one\nstill one"), ("t.txt#p1", "p two"),
                                                ("t.txt#p2", "p three")]
    lines = _load(tmp_path, kind="text", paths=[str(f)], split_by="line")
    assert [d.name for d in lines] == ["t.txt#L1", "t.txt#L2", "t.txt#L6", "t.txt#L8"]


def test_missing_and_empty_inputs_are_refused(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        _load(tmp_path, kind="text", paths=[str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match="matches no file"):
        _load(tmp_path, kind="text", paths=[str(tmp_path / "*.txt")])
    with pytest.raises(DataError, match="no data paths"):
        _load(tmp_path, kind="text", paths=[])
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "full.txt").write_text("words")
    with pytest.raises(DataError, match="empty.txt: the file is empty"):
        _load(tmp_path, kind="text", paths=[str(tmp_path)])
    assert [d.name for d in _load(tmp_path, kind="text", paths=[str(tmp_path)], skip_empty=True)] == ["full.txt"]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match="empty.jsonl: the file is empty"):
        _load(tmp_path, kind="jsonl", paths=[str(tmp_path / "empty.jsonl")])
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    with pytest.raises(DataError, match="blank.jsonl: no row has a non-empty 'text'"):
        _load(tmp_path, kind="jsonl", paths=[str(tmp_path / "blank.jsonl")])


def test_non_utf8_bytes_error_names_file_and_offset_or_are_replaced(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 ok\n".encode() + "na\u00efve".encode("latin-1"))  # \xef at byte 11
    with pytest.raises(DataError, match=r"latin1.txt: invalid UTF-8 at byte offset 11 "):
        _load(tmp_path, kind="text", paths=[str(f)])
    (doc,) = _load(tmp_path, kind="text", paths=[str(f)], on_decode_error="replace")
    assert doc.text == "caf\u00e9 ok\nna\ufffdve"
    j = tmp_path / "bad.jsonl"
    raw = b'{"text": "fine"}\n{"text": "bad \xff byte"}\n'
    j.write_bytes(raw)
    offset = raw.index(b"\xff")
    with pytest.raises(DataError, match=rf"bad.jsonl: invalid UTF-8 at byte offset {offset} "):
        _load(tmp_path, kind="jsonl", paths=[str(j)])
    docs = _load(tmp_path, kind="jsonl", paths=[str(j)], on_decode_error="replace")
    assert [d.text for d in docs] == ["fine", "bad \ufffd byte"]


def test_jsonl_fields_names_and_errors(tmp_path):
    f = tmp_path / "rows.jsonl"
    rows = [{"body": "alpha", "id": "a"}, {"body": "", "id": "empty"}, {"body": "gamma", "id": "c"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = _load(tmp_path, kind="jsonl", paths=[str(f)], text_field="body")
    assert [(d.name, d.text) for d in docs] == [("rows.jsonl:0", "alpha"), ("rows.jsonl:2", "gamma")]
    named = _load(tmp_path, kind="jsonl", paths=[str(f)], text_field="body", name_field="id")
    assert [d.name for d in named] == ["a", "c"]
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body', 'id'\]\)"):
        _load(tmp_path, kind="jsonl", paths=[str(f)])
    g = tmp_path / "dup.jsonl"
    g.write_text('{"text": "x", "id": "same"}\n{"text": "y", "id": "same"}\n')
    with pytest.raises(DataError, match="two documents are named 'same'"):
        _load(tmp_path, kind="jsonl", paths=[str(g)], name_field="id")


def test_parquet_source(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["one doc", "two doc"], "n": [1, 2]}).to_parquet(str(tmp_path / "d.parquet"))
    docs = _load(tmp_path, kind="parquet", paths=[str(tmp_path)])
    assert [(d.name, d.text) for d in docs] == [("d.parquet:0", "one doc"), ("d.parquet:1", "two doc")]
    with pytest.raises(DataError, match="'n' is int"):
        _load(tmp_path, kind="parquet", paths=[str(tmp_path)], text_field="n")


def test_hub_source_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="needs network access"):
        _load(tmp_path, kind="hub", hub_name="wikitext", hub_config="wikitext-2-raw-v1")
    with pytest.raises(DataError, match="unknown data source keys"):
        SourceConfig.from_dict({"kind": "text", "pathz": ["x"]})
