"""The preprocessed token store: tools/preprocess.py gives the documents (names and texts) the run
config's text sources give, the token stream in-process tokenization gives, byte for byte what the
tokenizer's own call gives, and batches over the memory-mapped store equal today's."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megatron_tc.data import DistributedBatchLoader, PackedSequences
from megatron_tc.data.bos import resolve_bos_id
from megatron_tc.data.documents import DataError
from megatron_tc.data.preprocess_cli import main as preprocess_main
from megatron_tc.data.sources import SourceConfig, load_documents
from megatron_tc.data.store_inputs import _paragraphs, corpus_files, read_named_documents
from megatron_tc.data.synthetic import synthetic_text, train_tiny_tokenizer
from megatron_tc.data.token_store import StoreMeta, open_token_store, write_token_store
from megatron_tc.data.tokenize import tokenize_documents
from megatron_tc.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok_dir = train_tiny_tokenizer(root / "tok", vocab_size=320)
    texts = [synthetic_text(int(n), seed=i) for i, n in enumerate(np.random.default_rng(0).integers(1, 120, 300))]
    rows = [json.dumps({"text": t}) for t in texts[:200]]
    rows[5], rows[9] = json.dumps({"text": "  \n"}), ""  # a row without text keeps its number; a blank line is no row
    (root / "a.jsonl").write_text("\n".join(rows) + "\n")
    (root / "b.txt").write_text("\n\n \n".join(texts[200:]) + "\n")
    assert preprocess_main(["--input", str(root / "a.jsonl"), str(root / "b.txt"), "--tokenizer", str(tok_dir),
                            "--out", str(root / "store"), "--threads", "2"]) == 0
    return root, tok_dir


def text_source_documents(root):
    """What the run config's text sources read from the same files."""
    return (load_documents(SourceConfig(kind="jsonl", paths=[str(root / "a.jsonl")]))
            + load_documents(SourceConfig(kind="text", split_by="paragraph", paths=[str(root / "b.txt")])))


def test_documents_and_tokens_equal_the_text_sources(corpus):
    root, tok_dir = corpus
    docs = text_source_documents(root)
    assert list(read_named_documents(corpus_files([str(root / "a.jsonl"), str(root / "b.txt")]))) == \
        [(d.name, d.text) for d in docs]
    tok = load_tokenizer(tok_dir)
    want = tokenize_documents(docs, tok, tok.eos_token_id, bos_id=resolve_bos_id(tok))
    got = open_token_store(root / "store")
    assert isinstance(got.tokens, np.memmap)
    assert np.array_equal(got.offsets, want.offsets) and np.array_equal(np.asarray(got.tokens), want.tokens)
    meta = StoreMeta.load(root / "store")
    assert (meta.documents, meta.tokens, meta.bos_id) == (len(docs), len(want.tokens), resolve_bos_id(tok))
    assert meta.max_token_id == int(want.tokens.max())


class _NoFastPath:
    """The tokenizer without its `tokenizers` backend: write_token_store falls back to its own call."""

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def test_fast_batch_encoding_writes_the_same_bytes_as_the_tokenizer_call(corpus, tmp_path):
    root, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    docs = list(read_named_documents(corpus_files([str(root / "a.jsonl"), str(root / "b.txt")])))
    write_token_store(docs, _NoFastPath(tok), tmp_path / "slow", tok.eos_token_id, bos_id=resolve_bos_id(tok),
                      chunk_chars=3000)
    for suffix in (".bin", ".idx", ".docs.tsv"):
        assert (tmp_path / f"slow{suffix}").read_bytes() == (root / f"store{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("seed", range(40))
def test_streamed_paragraphs_are_the_regex_split(tmp_path, seed):
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(["a", "b c", " ", "\t", "\n", "\n", "\n\n", " \n", "\r\n", "\u00a0"], size=30))
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    pieces = re.split(r"\n\s*\n", text.replace("\r\n", "\n"))
    want = [(f"t.txt#p{i}", p.strip()) for i, p in enumerate(pieces) if p.strip()]
    assert list(_paragraphs(tmp_path / "t.txt", "t.txt")) == want


def test_loader_batches_over_the_store_equal_todays_and_resume(corpus):
    root, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    today = PackedSequences(tokenize_documents(text_source_documents(root), tok, tok.eos_token_id,
                                               bos_id=resolve_bos_id(tok)), 32, pad_id=0)
    stored = PackedSequences(open_token_store(root / "store"), 32, pad_id=0)
    assert len(stored) == len(today) > 16
    ref = DistributedBatchLoader(today, 8, 2, seed=3)
    got = DistributedBatchLoader(stored, 8, 2, seed=3)
    for _ in range(2 * ref.steps_per_epoch + 1):  # across epoch boundaries (reshuffled)
        for a, b in zip(ref.next_step(), got.next_step()):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = DistributedBatchLoader(stored, 8, 2, seed=3)
    resumed.load_state_dict(got.state_dict())
    for a, b in zip(ref.next_step(), resumed.next_step()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_inputs_are_one_line_errors(corpus, tmp_path, capsys):
    root, tok_dir = corpus
    assert preprocess_main(["--input", str(tmp_path / "none.jsonl"), "--tokenizer", str(tok_dir),
                            "--out", str(tmp_path / "x")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    assert preprocess_main(["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tok_dir),
                            "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err.startswith("error: ") and "no 'text' field" in err
    (tmp_path / "named.jsonl").write_text('{"text": "x", "id": "a\\tb"}\n')
    assert preprocess_main(["--input", str(tmp_path / "named.jsonl"), "--tokenizer", str(tok_dir),
                            "--out", str(tmp_path / "z"), "--name-key", "id"]) == 2
    assert "tab or newline" in capsys.readouterr().err
    assert not (tmp_path / "z.json").exists()  # an interrupted store is never marked complete
    with pytest.raises(DataError, match="is missing"):
        open_token_store(tmp_path / "nothing")
    with pytest.raises(DataError, match="cannot read"):
        StoreMeta.load(tmp_path / "z")
