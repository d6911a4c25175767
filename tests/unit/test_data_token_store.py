"""The preprocessed token store: tools/preprocess.py with 2 worker processes gives the token
stream in-process tokenization gives, and the loader's batches over the memory-mapped store equal
today's (same windows, labels, document ids, positions, order, resume)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_tc.data import DistributedBatchLoader, PackedSequences
from megatron_tc.data.documents import DataError, Document
from megatron_tc.data.preprocess_cli import main as preprocess_main
from megatron_tc.data.synthetic import synthetic_text, train_tiny_tokenizer
from megatron_tc.data.token_store import open_token_store, read_documents
from megatron_tc.data.tokenize import tokenize_documents
from megatron_tc.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok_dir = train_tiny_tokenizer(root / "tok", vocab_size=320)
    texts = [synthetic_text(int(n), seed=i) for i, n in enumerate(np.random.default_rng(0).integers(1, 120, 300))]
    with open(root / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:200])
    (root / "b.txt").write_text("\n\n".join(texts[200:]) + "\n")
    texts = texts[:200] + [t.rstrip("\n") for t in texts[200:]]  # a .txt document ends at its last line
    assert preprocess_main(["--input", str(root / "a.jsonl"), str(root / "b.txt"), "--tokenizer", str(tok_dir),
                            "--out", str(root / "store"), "--workers", "2"]) == 0
    return root, tok_dir, texts


def test_store_equals_in_process_tokenization(corpus):
    root, tok_dir, texts = corpus
    assert list(read_documents([root / "a.jsonl", root / "b.txt"])) == texts
    tok = load_tokenizer(tok_dir)
    want = tokenize_documents([Document(str(i), t) for i, t in enumerate(texts)], tok, tok.eos_token_id)
    got = open_token_store(root / "store")
    assert isinstance(got.tokens, np.memmap)
    assert np.array_equal(got.offsets, want.offsets) and np.array_equal(np.asarray(got.tokens), want.tokens)


def test_loader_batches_over_the_store_equal_todays_and_resume(corpus):
    root, tok_dir, texts = corpus
    tok = load_tokenizer(tok_dir)
    today = PackedSequences(tokenize_documents([Document(str(i), t) for i, t in enumerate(texts)], tok,
                                               tok.eos_token_id), 32, pad_id=0)
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
    root, tok_dir, _ = corpus
    assert preprocess_main(["--input", str(tmp_path / "none.jsonl"), "--tokenizer", str(tok_dir),
                            "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: input")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    assert preprocess_main(["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tok_dir),
                            "--out", str(tmp_path / "y"), "--workers", "1"]) == 2
    assert "no 'text' field" in capsys.readouterr().err
    with pytest.raises(DataError, match="is missing"):
        open_token_store(tmp_path / "nothing")
