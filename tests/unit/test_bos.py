"""The BOS rule (megatron_tc.data.bos): read from the tokenizer per family, applied to evaluation
windows, calibration rows and packed training sequences, recorded in results; no BOS -> no change."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_tc.data import IGNORE_INDEX, DataConfig, DataError, PackedSequences, TokenStream, prepare_data
from megatron_tc.data.bos import bos_record, resolve_bos_id, tokenizer_adds_bos
from megatron_tc.data.packing import pack_window
from megatron_tc.data.synthetic import (
    gemma3_style_tokenizer,
    llama3_style_tokenizer,
    smollm2_style_tokenizer,
    synthetic_text,
    train_tiny_tokenizer,
    write_gguf_tokenizer,
    write_synthetic_corpus,
)
from megatron_tc.eval.perplexity import make_windows

TOKENIZERS = {"gemma3": gemma3_style_tokenizer, "llama3": llama3_style_tokenizer, "smollm2": smollm2_style_tokenizer}
ADDS_BOS = {"gemma3": True, "llama3": True, "smollm2": False}


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_the_rule_follows_how_each_family_encodes_text(family, tmp_path):
    from transformers import AutoTokenizer

    tok = TOKENIZERS[family]()
    assert tok.bos_token_id is not None
    assert tokenizer_adds_bos(tok) is ADDS_BOS[family]
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer_adds_bos(reloaded) is ADDS_BOS[family]
    assert resolve_bos_id(reloaded) == (tok.bos_token_id if ADDS_BOS[family] else None)
    assert resolve_bos_id(reloaded, True) == tok.bos_token_id
    assert resolve_bos_id(reloaded, "false") is None
    if family == "llama3":  # the post-processor adds BOS; the flag does not say so
        assert not reloaded.add_bos_token and reloaded("Hi")["input_ids"][0] == tok.bos_token_id


def test_the_rule_reads_gguf_metadata_and_sentencepiece_tokenizers(tmp_path):
    from megatron_tc.data import load_tokenizer

    for flag in (True, False):
        path = write_gguf_tokenizer(tmp_path / f"bos_{flag}.gguf", add_bos=flag)
        tok = load_tokenizer(path)
        assert tokenizer_adds_bos(tok) is flag and tok.bos_token_id == 1
    # the tokenizer tools/paper/data.py trains for the small pretrained teachers adds none
    assert not tokenizer_adds_bos(load_tokenizer(train_tiny_tokenizer(tmp_path / "spm")))


def test_bad_settings_are_refused_with_the_fix():
    from megatron_tc.config import ConfigError, load_config
    from megatron_tc.eval.tiny import word_tokenizer

    with pytest.raises(DataError, match="bos setting 'maybe' is not known; use auto"):
        resolve_bos_id(llama3_style_tokenizer(), "maybe")
    tok = word_tokenizer(["a", "b"])
    tok.bos_token = None
    with pytest.raises(DataError, match="bos=true but the tokenizer defines no BOS token"):
        resolve_bos_id(tok, True)
    with pytest.raises(ConfigError, match="data.bos: expected one of 'auto', true, false, got 'maybe'"):
        load_config(None, ["data.bos=maybe"], check=False)
    assert load_config(None, ["data.bos=false"], check=False).data.bos is False
    assert bos_record(7, "auto") == {"bos": True, "bos_token_id": 7, "bos_setting": "auto"}


# ---- evaluation windows --------------------------------------------------------------------------

def test_evaluation_windows_start_with_bos_and_predict_every_token_once():
    ids = torch.arange(10, 10 + 23)
    without = make_windows(ids, 8)
    assert [w.shape for w in without] == [(2, 8), (1, 7)]
    assert torch.equal(torch.cat([w.flatten() for w in without]), ids)  # unchanged: plain cuts
    windows = make_windows(ids, 8, bos_id=1)
    assert [w.shape for w in windows] == [(3, 8), (1, 3)]
    rows = [r for w in windows for r in w]
    assert all(int(r[0]) == 1 for r in rows)
    assert torch.equal(torch.cat([r[1:] for r in rows]), ids)  # the targets: every token, once
    # a window that opens on the text's own BOS (a document start) keeps it, not two
    stream = torch.tensor([1, 5, 6, 7, 2, 1, 8, 9, 2])
    rows = [r for w in make_windows(stream, 5, bos_id=1) for r in w]
    assert [r.tolist() for r in rows] == [[1, 5, 6, 7, 2], [1, 8, 9, 2]]
    rows = [r for w in make_windows(stream[1:], 4, bos_id=1) for r in w]
    assert [r.tolist() for r in rows] == [[1, 5, 6, 7], [1, 2, 1, 8], [1, 9, 2]]


def _tiny_teacher(family: str, tmp_path):
    from tests.converters.families import random_hf_model

    tok = TOKENIZERS[family]()
    model = random_hf_model("gemma3" if family == "gemma3" else "llama")
    assert model.config.vocab_size >= len(tok)
    model.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    return model, tok, tmp_path / "teacher"


def _transformers_ppl(model, tok, text: str, n_tokens: int, seq_len: int, bos: bool) -> tuple[float, int]:
    """The reference: transformers' own loss (labels=input_ids) on BOS + seq_len-1 token windows
    (or plain seq_len windows without BOS), summed over windows in fp64."""
    ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
    step = seq_len - 1 if bos else seq_len
    nll, count = 0.0, 0
    for start in range(0, len(ids), step):
        window = ([tok.bos_token_id] if bos else []) + ids[start:start + step]
        if len(window) < 2:
            continue
        x = torch.tensor([window])
        with torch.no_grad():
            loss = model(input_ids=x, labels=x).loss
        nll += float(loss) * (len(window) - 1)
        count += len(window) - 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("family", ["gemma3", "llama3", "smollm2"])
def test_evaluate_cli_equals_transformers_on_the_same_windows(family, tmp_path, capsys):
    from megatron_tc.eval.cli import evaluate_main

    model, tok, teacher_dir = _tiny_teacher(family, tmp_path)
    text = synthetic_text(120, seed=3)
    (tmp_path / "text.txt").write_text(text)
    argv = ["--model", str(teacher_dir), "--text", str(tmp_path / "text.txt"), "--seq-len", "16",
            "--max-tokens", "100", "--json", "--no-progress", "--device", "cpu"]
    assert evaluate_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bos = ADDS_BOS[family]
    ref_ppl, ref_tokens = _transformers_ppl(model, tok, text, 100, 16, bos)
    assert out["bos"] is bos and out["bos_token_id"] == (tok.bos_token_id if bos else None)
    assert out["bos_setting"] == "auto"
    assert out["tokens"] == ref_tokens == (100 if bos else 100 - 7)
    assert out["ppl"] == pytest.approx(ref_ppl, rel=1e-5)
    if bos:  # the override: the old windows, and a different number
        assert evaluate_main(argv + ["--bos", "false"]) == 0
        off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert off["bos"] is False and off["bos_setting"] is False
        assert off["ppl"] == pytest.approx(_transformers_ppl(model, tok, text, 100, 16, False)[0], rel=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "llama3"])
def test_a_converted_teacher_scores_itself_as_transformers_does(family, tmp_path, capsys):
    """The user's check: convert, then `evaluate.py --model T --teacher T` on the checkpoint."""
    from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_tc.eval.cli import evaluate_main

    model, tok, teacher_dir = _tiny_teacher(family, tmp_path)
    convert_hf_to_megatron(teacher_dir, tmp_path / "ckpt")
    text = synthetic_text(120, seed=6)
    (tmp_path / "text.txt").write_text(text)
    ckpt = str(tmp_path / "ckpt")
    assert evaluate_main(["--model", ckpt, "--teacher", ckpt, "--text", str(tmp_path / "text.txt"), "--seq-len", "32",
                          "--max-tokens", "120", "--json", "--no-progress", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref_ppl, ref_tokens = _transformers_ppl(model, tok, text, 120, 32, bos=True)
    assert out["bos"] is True and out["tokens"] == ref_tokens == 120
    assert out["teacher_ppl"] == pytest.approx(ref_ppl, rel=1e-4) and out["ppl"] == pytest.approx(ref_ppl, rel=1e-4)
    assert out["kl"] == pytest.approx(0.0, abs=1e-6) and out["top1_agree"] == 1.0


def test_long_context_prompts_start_with_bos():
    from megatron_tc.eval.long_context import make_examples

    tok = llama3_style_tokenizer()
    keys = ["kabo", "seti", "mura", "dolu", "fena", "gori", "paki", "lomu"]
    for ex in make_examples(tok, [256], samples=3, seed=1, value_digits=2, keys=keys, bos_id=tok.bos_token_id)[256]:
        assert ex.prompt_ids[0] == tok.bos_token_id and tok.bos_token_id not in ex.prompt_ids[1:]
        assert len(ex.prompt_ids) <= 256
        text = tok.decode(ex.prompt_ids[1:] + ex.answer_ids)
        assert tok(text, add_special_tokens=False)["input_ids"] == ex.prompt_ids[1:] + ex.answer_ids
    plain = make_examples(tok, [256], samples=3, seed=1, value_digits=2, keys=keys)[256]
    assert all(ex.prompt_ids[0] != tok.bos_token_id for ex in plain)


# ---- calibration rows and the statistics file --------------------------------------------------

def test_statistics_rows_start_with_bos_and_the_file_records_it(tmp_path):
    from megatron_tc.calibrate.cli import stats_main
    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.calibrate.teacher_io import text_batches

    _, tok, teacher_dir = _tiny_teacher("llama3", tmp_path)
    (tmp_path / "calib.txt").write_text(synthetic_text(200, seed=4))
    batches = text_batches(tmp_path / "calib.txt", tok, 60, 16, bos_id=tok.bos_token_id)
    rows = torch.cat([b["input_ids"] for b in batches])
    assert rows.shape == (4, 16) and bool((rows[:, 0] == tok.bos_token_id).all())
    assert not bool((rows[:, 1:] == tok.bos_token_id).any())
    plain = torch.cat([b["input_ids"] for b in text_batches(tmp_path / "calib.txt", tok, 60, 16)])
    assert torch.equal(plain.flatten(), torch.tensor(tok(synthetic_text(200, seed=4), add_special_tokens=False)
                                                     ["input_ids"][:48]))  # no BOS: the old rows
    for setting, expect in (("auto", True), ("false", False)):
        out = tmp_path / f"stats_{setting}.pt"
        assert stats_main(["--teacher", str(teacher_dir), "--text", str(tmp_path / "calib.txt"), "--tokens", "32",
                           "--seq-len", "16", "--layers", "0", "--readout", "", "--no-progress", "--bos", setting,
                           "--out", str(out)]) == 0
        meta = TaylorStats.load(out).meta
        assert meta["bos"] is expect and meta["bos_token_id"] == (tok.bos_token_id if expect else None)


# ---- packed sequences (training, calibration and eval splits of a run) ---------------------------

def _stream(docs: list[list[int]]) -> TokenStream:
    return TokenStream.from_token_lists(docs)


def test_packed_sequences_start_with_bos_and_predict_every_token_once():
    bos, eos = 1, 2
    docs = [[bos] + list(range(10, 10 + n)) + [eos] for n in (3, 17, 1, 9)]
    stream = _stream(docs)
    T = 6
    seqs = PackedSequences(stream, T, pad_id=0, drop_last=False, bos_id=bos)
    targets = []
    for i in range(len(seqs)):
        s = seqs[i]
        assert int(s["input_ids"][0]) == bos and int(s["input_ids"][1]) != bos  # one BOS, never two
        assert int(s["position_ids"][0]) == 0 and int(s["doc_ids"][0]) == 0
        real = s["labels"] != IGNORE_INDEX
        targets += s["labels"][real].tolist()
        # labels are the next input inside a segment; the BOS shares its first token's segment
        same = s["doc_ids"][1:] == s["doc_ids"][:-1]
        assert bool((s["labels"][:-1][real[:-1] & same] == s["input_ids"][1:][real[:-1] & same]).all())
        assert torch.equal(s["position_ids"], _positions(s["doc_ids"]))
    # every stream token except each document's own BOS is a target exactly once, in order
    expected = [t for d in docs for t in d[1:]]
    assert targets == expected
    assert seqs.num_label_tokens() == len(stream.tokens) - stream.num_docs
    assert len(PackedSequences(stream, T, 0, drop_last=True, bos_id=bos)) == len(stream.tokens) // (T - 1)


def _positions(doc_ids: torch.Tensor) -> torch.Tensor:
    out, pos = [], 0
    for i, d in enumerate(doc_ids.tolist()):
        pos = 0 if i == 0 or d != doc_ids[i - 1] else pos + 1
        out.append(pos)
    return torch.tensor(out)


def test_a_sequence_opening_on_its_documents_bos_takes_one_more_token_as_context():
    bos, eos = 1, 2
    stream = _stream([[bos, 5, 6, 7, eos], [bos, 8, 9, 10, 11, 12, eos]])
    s = pack_window(stream, 5, 4, pad_id=0, bos_id=bos)  # stream[5] opens document 1 with its BOS
    assert s["input_ids"].tolist() == [bos, 8, 9, 10]
    assert s["labels"].tolist() == [8, 9, IGNORE_INDEX, IGNORE_INDEX]  # 10 is the next sequence's
    assert s["position_ids"].tolist() == [0, 1, 2, 3]
    s = pack_window(stream, 2, 4, pad_id=0, bos_id=bos)  # mid-document, crossing into document 1
    assert s["input_ids"].tolist() == [bos, 6, 7, eos]
    assert s["labels"].tolist() == [6, 7, eos, IGNORE_INDEX]
    assert s["doc_ids"].tolist() == [0, 0, 0, 0] and s["position_ids"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("family", ["gemma3", "smollm2"])
def test_prepared_data_follows_the_rule_and_is_unchanged_without_bos(family, tmp_path):
    tok = TOKENIZERS[family]()
    write_synthetic_corpus(tmp_path / "corpus", n_docs=8, words_per_doc=(10, 60), seed=2)
    base = {"source": {"kind": "text", "paths": [str(tmp_path / "corpus")]}, "seq_len": 24,
            "split": {"calibration_fraction": 0.25, "eval_fraction": 0.25}}
    runs = {s: prepare_data(DataConfig.from_dict(base | {"bos": s}), tmp_path / f"run_{s}", tokenizer=tok)
            for s in ("auto", False)}
    auto, off = runs["auto"], runs[False]
    assert auto.bos_record()["bos"] is ADDS_BOS[family] and off.bos_id is None
    train_auto, train_off = auto.sequences("train"), off.sequences("train")
    first_tokens = {int(train_auto[i]["input_ids"][0]) for i in range(len(train_auto))}
    if ADDS_BOS[family]:
        assert first_tokens == {tok.bos_token_id}
        calib = auto.sampled_sequences("calibration", 48)
        assert bool((calib["input_ids"][:, 0] == tok.bos_token_id).all())
        assert train_auto.fingerprint != train_off.fingerprint
    else:  # bit-identical batches, cache key and fingerprint
        assert train_auto.fingerprint == train_off.fingerprint
        assert np.array_equal(np.asarray(train_auto.stream.tokens), np.asarray(train_off.stream.tokens))
        batch = list(range(len(train_off)))
        for key, value in train_off.batch(batch).items():
            assert torch.equal(train_auto.batch(batch)[key], value)
        # the no-BOS packing is the plain stream cut into T-token windows
        T = train_off.seq_len
        assert torch.equal(train_off.batch(batch)["input_ids"].flatten(),
                           torch.from_numpy(np.asarray(train_off.stream.tokens[: len(batch) * T], np.int64)))
    # with the rule on, every document of the stream opens with BOS, whatever the tokenizer does
    forced = prepare_data(DataConfig.from_dict(base | {"bos": True, "add_special_tokens": False}),
                          tmp_path / "run_forced", tokenizer=tok)
    stream, _ = forced.token_stream("train")
    assert bool((np.asarray(stream.tokens)[stream.offsets[:-1]] == tok.bos_token_id).all())


# ---- the pipeline: one convention from teacher to results ------------------------------------------

def test_pipeline_records_the_convention_in_manifest_stats_and_results(tmp_path):
    """tools/distill.py's main (one gloo rank of the test harness) on a teacher whose tokenizer adds
    BOS the Llama-3 way."""
    from pathlib import Path

    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.testing import run_distributed
    from tests._scripts import distill_main

    root = Path(__file__).resolve().parents[2]
    _, tok, teacher_dir = _tiny_teacher("llama3", tmp_path)
    write_synthetic_corpus(tmp_path / "text", n_docs=16, words_per_doc=(40, 120), seed=5)
    run = tmp_path / "run"
    argv = [str(root / "configs" / "tiny.yaml"), f"run.run_dir={run}",
            "run.stages=[convert,select,stats,init,stage2,eval]", f"model.teacher={teacher_dir}",
            f"data.source.paths=[{tmp_path / 'text'}]", "data.source.split_by=file",
            "distill.stage2.steps=2", "data.seq_len=16", "data.calib_tokens=64", "data.eval_tokens=64"]
    run_distributed(distill_main, 1, argv, timeout=400)
    record = {"bos": True, "bos_token_id": tok.bos_token_id, "bos_setting": "auto"}
    assert json.loads((run / "manifest.json").read_text())["data"] == record
    assert {k: TaylorStats.load(run / "stats" / "stats.pt").meta[k] for k in record} == record
    for name in ("eval/results.json", "run.json", "init/report.json"):
        assert {k: json.loads((run / name).read_text())[k] for k in record} == record
    assert "windows of 16 tokens (each starting with BOS)" in (run / "eval" / "results.md").read_text()
