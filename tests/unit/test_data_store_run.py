"""A run config reading a token store (`data.token_store`) gives the run exactly the data of the
same documents read as text: the same splits, training batches, calibration rows and evaluation
tokens; a resumed loader continues the same sequence; a store that does not match the run is
refused with one line saying why."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_tc.config import load_config
from megatron_tc.config.errors import ConfigError
from megatron_tc.data import SPLITS, DataConfig, prepare_data
from megatron_tc.data.documents import DataError
from megatron_tc.data.preprocess_cli import main as preprocess_main
from megatron_tc.data.synthetic import synthetic_text, train_tiny_tokenizer
from megatron_tc.data.tokenizer import load_tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("store_run")
    tok_dir = train_tiny_tokenizer(root / "tok", vocab_size=320)
    lengths = np.random.default_rng(1).integers(1, 60, 160)
    texts = [synthetic_text(int(n), seed=100 + i) for i, n in enumerate(lengths)]
    texts[40] = texts[7]  # a duplicate text, dropped by data.dedupe on both paths
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for bos in ("auto", "true"):
        assert preprocess_main(["--input", str(root / "docs.jsonl"), "--tokenizer", str(tok_dir), "--bos", bos,
                                "--out", str(root / f"store_{bos}"), "--threads", "2"]) == 0
    return root, tok_dir


def run_data(overrides, run_dir, tok):
    cfg = load_config(None, [f"data.seq_len={SEQ}", "data.split.calibration_fraction=0.1",
                             "data.split.eval_fraction=0.1", *overrides])
    return prepare_data(DataConfig.from_config(cfg.data), run_dir, tokenizer=tok)


def text_and_store(corpus, tmp_path, bos="auto", extra=()):
    root, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    text = run_data(["data.source.kind=jsonl", f"data.source.paths=[{root / 'docs.jsonl'}]", f"data.bos={bos}",
                     *extra], tmp_path / "text_run", tok)
    store = run_data([f"data.token_store={root / f'store_{bos}'}", f"data.bos={bos}", *extra],
                     tmp_path / "store_run", tok)
    return text, store


def assert_batches_equal(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bos, extra", [("auto", ()), ("true", ("data.split.eval_docs=[docs.jsonl:3,docs.jsonl:150]",))])
def test_a_store_gives_the_text_path_data(corpus, tmp_path, bos, extra):
    text, store = text_and_store(corpus, tmp_path, bos, extra)
    assert store.bos_id == text.bos_id and (store.bos_id is not None) == (bos == "true")
    for split in SPLITS:
        assert store.manifest.names(split) == text.manifest.names(split)
        assert np.array_equal(np.asarray(store.token_stream(split)[0].tokens), text.token_stream(split)[0].tokens)
    assert "docs.jsonl:40" not in sum((store.manifest.names(s) for s in SPLITS), [])
    loaders = [d.loader("train", global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=5)
               for d in (text, store)]
    for _ in range(2 * loaders[0].steps_per_epoch + 1):  # across an epoch boundary (reshuffled)
        for a, b in zip(loaders[0].next_step(), loaders[1].next_step()):
            assert_batches_equal(a, b)
    assert_batches_equal(text.sampled_sequences("calibration", 4 * SEQ, skip_tokens=SEQ),
                         store.sampled_sequences("calibration", 4 * SEQ, skip_tokens=SEQ))
    assert_batches_equal(text.first_sequences("eval", 3 * SEQ), store.first_sequences("eval", 3 * SEQ))
    assert torch.equal(text.token_ids("eval", 100), store.token_ids("eval", 100))
    decoded = store.documents("eval")  # the store holds no text: decoded from the tokens
    assert [d.name for d in decoded] == [d.name for d in text.documents("eval")]
    assert [d.text.split() for d in decoded] == [d.text.split() for d in text.documents("eval")]
    manifest = json.loads((tmp_path / "store_run" / "data_manifest.json").read_text())
    assert [e["name"] for e in manifest["splits"]["eval"]] == text.manifest.names("eval")
    assert manifest["summary"]["train"]["tokens"] == len(text.token_stream("train")[0].tokens)


def test_a_resumed_store_loader_continues_the_sequence(corpus, tmp_path):
    root, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    overrides = [f"data.token_store={root / 'store_auto'}"]
    whole = run_data(overrides, tmp_path / "run", tok).loader("train", global_batch_size=4, micro_batch_size=2, seed=7)
    first = run_data(overrides, tmp_path / "run", tok).loader("train", global_batch_size=4, micro_batch_size=2, seed=7)
    for _ in range(3):
        whole.next_step(), first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    again = run_data(overrides, tmp_path / "run", tok)  # a new process over the same run directory
    resumed = again.loader("train", global_batch_size=4, micro_batch_size=2, seed=7)
    resumed.load_state_dict(state)
    for _ in range(whole.steps_per_epoch):
        for a, b in zip(whole.next_step(), resumed.next_step()):
            assert_batches_equal(a, b)


def test_a_store_that_does_not_match_the_run_is_refused(corpus, tmp_path):
    root, tok_dir = corpus
    tok = load_tokenizer(tok_dir)
    store = f"data.token_store={root / 'store_auto'}"
    with pytest.raises(ConfigError, match="exclusive"):
        load_config(None, [store, "data.source.kind=jsonl", f"data.source.paths=[{root / 'docs.jsonl'}]"])
    with pytest.raises(DataError, match="exclusive"):
        prepare_data(DataConfig.from_dict({"token_store": str(root / "store_auto"),
                                           "source": {"kind": "text", "paths": ["x"]}}), None, tokenizer=tok)
    other = load_tokenizer(train_tiny_tokenizer(tmp_path / "other", vocab_size=340, seed=1))
    with pytest.raises(DataError, match="another tokenizer"):
        run_data([store], tmp_path / "a", other)
    with pytest.raises(DataError, match="BOS"):
        run_data([store, "data.bos=true"], tmp_path / "b", tok)
    with pytest.raises(DataError, match="ends documents with token"):
        run_data([store, "data.eos_token=<unk>"], tmp_path / "c", tok)
    with pytest.raises(DataError, match="add_special_tokens"):
        run_data([store, "data.add_special_tokens=false"], tmp_path / "d", tok)
    run_data(["data.source.kind=jsonl", f"data.source.paths=[{root / 'docs.jsonl'}]"], tmp_path / "e", tok)
    with pytest.raises(DataError, match="text sources"):
        run_data([store], tmp_path / "e", tok)
    run_data([store], tmp_path / "f", tok)
    with pytest.raises(DataError, match="another split settings"):
        run_data([store, "data.split.seed=9"], tmp_path / "f", tok)
    with pytest.raises(DataError, match="another token store"):
        run_data([f"data.token_store={root / 'store_true'}", "data.bos=true"], tmp_path / "f", tok)
    with pytest.raises(DataError, match="cannot read"):
        run_data([f"data.token_store={tmp_path / 'missing'}"], tmp_path / "g", tok)


def test_a_pipeline_run_over_a_store_equals_the_run_over_text(tmp_path):
    """tools/distill.py's main (one gloo rank of the test harness, a teacher whose tokenizer adds BOS)
    over text paragraphs and over a store of the same files: the same statistics, the same
    distillation and the same evaluation."""
    from pathlib import Path

    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.testing import run_distributed
    from tests._scripts import distill_main
    from megatron_tc.data.synthetic import llama3_style_tokenizer, write_synthetic_corpus
    from tests.converters.families import random_hf_model

    root = Path(__file__).resolve().parents[2]
    teacher = tmp_path / "teacher"
    random_hf_model("llama").save_pretrained(teacher)
    llama3_style_tokenizer().save_pretrained(teacher)
    write_synthetic_corpus(tmp_path / "text", n_docs=16, words_per_doc=(40, 120), seed=5)
    assert preprocess_main(["--input", str(tmp_path / "text"), "--tokenizer", str(teacher),
                            "--out", str(tmp_path / "store")]) == 0
    common = ["run.stages=[convert,select,stats,init,stage2,eval]", f"model.teacher={teacher}",
              "distill.stage2.steps=2", "data.seq_len=16", "data.calib_tokens=64", "data.eval_tokens=64"]
    sources = {"text": [f"data.source.paths=[{tmp_path / 'text'}]"],
               "store": ["data.source.kind=shakespeare", "data.source.paths=[]", "data.source.split_by=file",
                         f"data.token_store={tmp_path / 'store'}"]}
    for name, overrides in sources.items():
        run_distributed(distill_main, 1, [str(root / "configs" / "tiny.yaml"), f"run.run_dir={tmp_path / name}",
                                          *common, *overrides], timeout=400)
    text, store = (TaylorStats.load(tmp_path / name / "stats" / "stats.pt") for name in sources)
    assert text.meta["bos"] is True and text.meta["documents"] == store.meta["documents"]
    assert text.sums.keys() == store.sums.keys() and all(torch.equal(text.sums[k], store.sums[k]) for k in text.sums)
    results = [[{k: v for k, v in row.items() if k != "path"}  # the run directory's own path
                for row in json.loads((tmp_path / name / "eval" / "results.json").read_text())["rows"]]
               for name in sources]
    assert len(results[0]) >= 2 and results[0] == results[1]  # the teacher and the distilled student
