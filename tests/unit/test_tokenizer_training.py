"""megatron_tc.data.tokenizer_training and paper_corpus: the offline tokenizers and the paper's split."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("sentencepiece")

ROOT = Path(__file__).resolve().parents[2]


def _lines(n: int = 400) -> list[str]:
    rng = random.Random(0)
    words = ["king", "crown", "sword", "night", "river", "honour", "queen", "storm", "field", "letter"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def test_unigram_tokenizer_special_ids_byte_fallback_and_determinism(tmp_path):
    from transformers import AutoTokenizer

    from megatron_tc.data.tokenizer_training import train_unigram_tokenizer

    for name in ("a", "b"):
        train_unigram_tokenizer(_lines(), tmp_path / name, 280, input_sentence_size=10_000, num_threads=1)
    assert not (tmp_path / "a" / "tokenizer.vocab").exists()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "the king's €uro ☃"  # characters never seen in training: byte fallback, no <unk>
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert AutoTokenizer.from_pretrained(str(tmp_path / "b")).get_vocab() == tok.get_vocab()


def test_pinned_paper_split_is_the_base_config_split():
    import yaml

    from megatron_tc.data.paper_corpus import pinned

    calibration, evaluation = pinned()
    split = yaml.safe_load((ROOT / "configs" / "paper" / "base.yaml").read_text())["data"]["split"]
    assert (calibration, evaluation) == (split["calibration_docs"], split["eval_docs"])
    assert calibration and evaluation and not set(calibration) & set(evaluation)
