"""tools/stats.py, calibrate.py and select_layers.py reading a token store (--token-store): the
rows and statistics of a document equal those of the same text given as --text; the rows are a
run's calibration rows; overlap with --eval-text, another tokenizer, another BOS convention and
giving both or neither of --text / --token-store are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_tc.calibrate.calib_source import StoreSource, TextSource
from megatron_tc.calibrate.cli import calibrate_main, select_main, stats_main
from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.config import load_config
from megatron_tc.data import DataConfig, prepare_data
from megatron_tc.data.manifest import SplitConfig
from megatron_tc.data.overlap import text_record
from megatron_tc.data.preprocess_cli import main as preprocess_main
from megatron_tc.data.synthetic import (gemma3_style_tokenizer, llama3_style_tokenizer, smollm2_style_tokenizer,
                                        synthetic_text, train_tiny_tokenizer)
from megatron_tc.data.tokenizer import load_tokenizer as load_tokenizer_dir
from megatron_tc.eval.loading import load_tokenizer

SEQ = 32


def _paragraphs(seed: int, count: int) -> list[str]:
    return [synthetic_text(40, seed=seed * 100 + i).replace("\n", " ") for i in range(count)]


def _teacher(path, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny HF teacher (byte-level tokenizer, no BOS); a store of one multi-paragraph document
    "book" plus 20 others; the book's text as a file; the store written again with another tokenizer."""
    root = tmp_path_factory.mktemp("store_cli")
    teacher = _teacher(root / "teacher", smollm2_style_tokenizer())
    book = "\n\n".join(_paragraphs(1, 6))
    rows = [{"name": "book", "text": book}] + [{"name": f"d{i}", "text": t} for i, t in enumerate(_paragraphs(2, 20))]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "book.txt").write_text(book + "\n")
    common = ["--input", str(root / "docs.jsonl"), "--name-key", "name", "--threads", "1"]
    assert preprocess_main(common + ["--tokenizer", str(teacher), "--out", str(root / "store")]) == 0
    other = root / "other_tok"
    llama3_style_tokenizer().save_pretrained(str(other))
    assert preprocess_main(common + ["--tokenizer", str(other), "--out", str(root / "other_store")]) == 0
    return root, teacher, book


def _store_args(root, *extra):
    return ["--token-store", str(root / "store"), "--split", "calibration_docs=[book]", *extra]


def test_a_store_document_gives_the_rows_and_statistics_of_the_same_text(setup, tmp_path):
    root, teacher, book = setup
    tok = load_tokenizer(teacher)
    split = SplitConfig(calibration_docs=["book"])
    store = StoreSource(str(root / "store"), tok, "auto", split, "stream")
    text = TextSource(str(root / "book.txt"))
    for skip in (0, 2 * SEQ):  # the calibration rows and the held-out rows after them
        a, b = (s.batches(tok, 2 * SEQ, SEQ, None, skip_tokens=skip) for s in (text, store))
        assert len(a) == len(b) == 2
        assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
        assert all(torch.equal(y["doc_ids"], torch.zeros(1, SEQ, dtype=torch.long)) for y in b)
    assert store.record["paragraph_hashes"] == text.record["paragraph_hashes"] and store.record["paragraphs"] == 6

    common = ["--teacher", str(teacher), "--tokens", str(2 * SEQ), "--seq-len", str(SEQ), "--no-progress",
              "--readout", "taylor"]
    assert stats_main(common + ["--text", str(root / "book.txt"), "--out", str(tmp_path / "t.pt")]) == 0
    assert stats_main(common + _store_args(root, "--calib-order", "stream", "--out", str(tmp_path / "s.pt"))) == 0
    from_text, from_store = TaylorStats.load(tmp_path / "t.pt"), TaylorStats.load(tmp_path / "s.pt")
    assert from_text.sums.keys() == from_store.sums.keys() and len(from_text.sums) > 0
    for key in from_text.sums:
        torch.testing.assert_close(from_store.sums[key], from_text.sums[key], rtol=1e-9, atol=1e-9)
    meta = from_store.meta
    assert meta["text_record"]["paragraph_hashes"] == text_record(root / "book.txt")["paragraph_hashes"]
    assert meta["documents"] == ["book"] and meta["calib_order"] == "stream" and meta["tokens"] == 2 * SEQ


def test_the_store_rows_are_the_runs_calibration_rows(setup):
    root, teacher, _ = setup
    tok = load_tokenizer(teacher)
    cfg = load_config(None, [f"data.token_store={root / 'store'}", f"data.seq_len={SEQ}"])
    run = prepare_data(DataConfig.from_config(cfg.data), None, tokenizer=tok)
    rows = run.sampled_sequences("calibration", 3 * SEQ, SEQ, SEQ, order=cfg.data.calib_order)
    import argparse

    from megatron_tc.calibrate.calib_source import add_source_args, open_source

    ap = argparse.ArgumentParser()
    add_source_args(ap)
    ap.add_argument("--teacher")
    ap.add_argument("--bos", default="auto")
    tool = open_source(ap.parse_args(["--teacher", str(teacher), "--token-store", str(root / "store")]))
    batches = tool.batches(tok, 3 * SEQ, SEQ, run.bos_id, skip_tokens=SEQ)  # the tool's defaults are the run's
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), rows["input_ids"])
    assert torch.equal(torch.cat([b["doc_ids"] for b in batches]), rows["doc_ids"])
    assert tool.document_names() == run.manifest.names("calibration")


def test_a_store_and_the_tools_select_and_calibrate(setup, tmp_path):
    root, teacher, _ = setup
    common = ["--teacher", str(teacher), "--tokens", str(2 * SEQ), "--seq-len", str(SEQ), "--no-progress",
              *_store_args(root)]
    assert select_main(common + ["--policy", "uniform", "--num-keep", "1", "--out", str(tmp_path / "keep.json")]) == 0
    keep = json.loads((tmp_path / "keep.json").read_text())
    assert keep["token_store"] == str(root / "store") and keep["split"]["calibration_docs"] == ["book"]
    out = tmp_path / "student"
    assert calibrate_main(common + ["--init", "taylor_fit", "--keep", "1", "--align-steps", "2",
                                    "--out", str(out)]) == 0
    report = json.loads((out / "calibrate_report.json").read_text())
    assert report["token_store"] == str(root / "store") and report["align"]["0"]["best_step"] in (0, 2)
    with pytest.raises(SystemExit, match=r"held-out calibration tokens .* the calibration split of"):
        calibrate_main(common[:2] + ["--tokens", str(36 * SEQ)] + common[4:] +
                       ["--init", "taylor_fit", "--keep", "1", "--align-steps", "2"])


@pytest.mark.parametrize("main,extra", [
    (stats_main, ["--out", "x.pt"]),
    (calibrate_main, ["--init", "naive", "--keep", "0"]),
    (select_main, ["--policy", "uniform", "--out", "x.json"]),
])
def test_a_store_sharing_a_paragraph_with_the_evaluation_text_is_refused(setup, tmp_path, main, extra):
    root, teacher, book = setup
    evaluation = tmp_path / "eval.txt"
    evaluation.write_text("\n\n".join(_paragraphs(3, 4) + [book.split("\n\n")[4]]) + "\n")
    args = ["--teacher", str(teacher), "--eval-text", str(evaluation), *_store_args(root)]
    with pytest.raises(SystemExit, match=r"error: calibration text token store .*store \(calibration split, 1 "
                                         r"documents\) shares 1 paragraph"):
        main(args + extra)
    evaluation.write_text("\n\n".join(_paragraphs(3, 4)) + "\n")  # disjoint: accepted
    if main is stats_main:
        assert main(args + ["--tokens", str(SEQ), "--seq-len", str(SEQ), "--readout", "", "--layers", "0",
                            "--no-progress", "--out", str(tmp_path / "x.pt")]) == 0


def test_a_store_of_another_tokenizer_or_bos_is_refused(setup, tmp_path):
    root, teacher, _ = setup
    common = ["--teacher", str(teacher), "--out", str(tmp_path / "x.pt")]
    with pytest.raises(SystemExit, match=r"error: --token-store .*other_store: .* another tokenizer"):
        stats_main(common + ["--token-store", str(root / "other_store")])
    with pytest.raises(SystemExit, match=r"error: --token-store .*store: .* written with BOS None"):
        stats_main(common + ["--token-store", str(root / "store"), "--bos", "true"])
    with pytest.raises(SystemExit, match=r"error: --split: unknown split keys \['sed'\]"):
        stats_main(common + ["--token-store", str(root / "store"), "--split", "sed=1"])
    with pytest.raises(SystemExit, match=r"error: --split and --calib-order apply to --token-store only"):
        stats_main(common + ["--text", str(root / "book.txt"), "--calib-order", "stream"])
    shutil.copy(root / "store.json", tmp_path / "copy.json")  # a store without its .bin/.idx
    shutil.copy(root / "store.docs.tsv", tmp_path / "copy.docs.tsv")
    with pytest.raises(SystemExit, match=r"error: --token-store .*copy: .*copy.bin is missing"):
        stats_main(common + ["--token-store", str(tmp_path / "copy")])


@pytest.mark.parametrize("main,extra", [
    (stats_main, ["--out", "x.pt"]),
    (calibrate_main, ["--init", "naive", "--keep", "0"]),
    (select_main, ["--policy", "uniform", "--out", "x.json"]),
])
def test_both_or_neither_text_and_store_is_refused(setup, capsys, main, extra):
    root, teacher, _ = setup
    args = ["--teacher", str(teacher), *extra]
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and "one of the arguments --text --token-store is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(args + ["--text", str(root / "book.txt"), "--token-store", str(root / "store")])
    assert err.value.code == 2 and "--token-store: not allowed with argument --text" in capsys.readouterr().err


def test_decoded_text_is_compared_as_the_tokenizer_gives_it_back(setup, tmp_path):
    """A tokenizer that does not give the text back (an unknown character) still finds a shared
    paragraph; one that drops blank lines is refused."""
    from megatron_tc.data.overlap import OverlapError, check_disjoint

    root, _, _ = setup
    spaced = "The caf\u00e9 by the harbour opened at six and closed when the last boat came back in."
    corpus = root.parent / "spaced"
    corpus.mkdir(exist_ok=True)
    rows = [{"name": "a", "text": f"{spaced}\n\n{_paragraphs(4, 1)[0]}"}] + [
        {"name": f"b{i}", "text": t} for i, t in enumerate(_paragraphs(5, 9))]
    (corpus / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gemma3_style_tokenizer().save_pretrained(str(tmp_path / "lossy"))  # no byte fallback: "\u00e9" is <unk>
    assert preprocess_main(["--input", str(corpus / "docs.jsonl"), "--name-key", "name", "--tokenizer",
                            str(tmp_path / "lossy"), "--out", str(tmp_path / "store")]) == 0
    tok = load_tokenizer_dir(tmp_path / "lossy")
    store = StoreSource(str(tmp_path / "store"), tok, "auto", SplitConfig(calibration_docs=["a"]), "random")
    evaluation = tmp_path / "eval.txt"
    evaluation.write_text(spaced + "\n")
    assert not set(store.record["paragraph_hashes"]) & set(text_record(evaluation)["paragraph_hashes"])
    with pytest.raises(OverlapError, match="shares 1 paragraph"):
        check_disjoint(store.record, store.comparable(text_record(evaluation)))

    whitespace_tok = load_tokenizer_dir(train_tiny_tokenizer(tmp_path / "tt", vocab_size=320))  # drops "\n\n"
    dropping = _teacher(tmp_path / "dropping", whitespace_tok)
    assert preprocess_main(["--input", str(corpus / "docs.jsonl"), "--name-key", "name", "--tokenizer", str(dropping),
                            "--out", str(tmp_path / "dropping_store")]) == 0
    with pytest.raises(SystemExit, match="does not give blank lines back"):
        stats_main(["--teacher", str(dropping), "--token-store", str(tmp_path / "dropping_store"), "--out",
                    str(tmp_path / "x.pt")])
