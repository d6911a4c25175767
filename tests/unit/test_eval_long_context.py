"""Associative-recall probe: prompt construction, exact scoring through both methods, real tiny models."""

import json

import pytest
import torch

from megatron_tc.eval.long_context import HEADER, key_words, make_examples, run_probe, value_words
from megatron_tc.eval.loading import greedy_generate, load_model
from megatron_tc.eval.tiny import save_hf, tiny_llama, word_tokenizer

KEYS = key_words(60, syllables=2)
VALUES = value_words(2)
TOK = word_tokenizer(HEADER.split() + ["="] + KEYS + VALUES)
EQ = TOK.convert_tokens_to_ids("=")
V = len(TOK)


def recall_oracle(input_ids):
    """Perfect associative recall: after 'key =' predict the token that followed 'key =' earlier."""
    logits = torch.zeros(*input_ids.shape, V)
    for b, row in enumerate(input_ids.tolist()):
        seen = {}
        for t in range(len(row)):
            if t >= 2 and row[t - 1] == EQ:
                seen[row[t - 2]] = row[t]
            if row[t] == EQ and t >= 1 and row[t - 1] in seen:
                logits[b, t, seen[row[t - 1]]] = 10.0
    return logits


def test_examples_are_well_formed():
    ex = make_examples(TOK, [64, 200], samples=5, seed=1, value_digits=2, keys=KEYS)
    for L, exs in ex.items():
        for e in exs:
            assert L - 12 <= e.context_tokens <= L
            assert len(e.candidates) == 4 and e.candidates[e.gold] == e.answer_ids
            assert len({tuple(c) for c in e.candidates}) == 4
            assert e.prompt_ids[-1] == EQ
            key = e.prompt_ids[-2]
            pos = [i for i in range(len(e.prompt_ids) - 2) if e.prompt_ids[i] == key]
            assert len(pos) == 1 and e.prompt_ids[pos[0] + 2] == e.answer_ids[0]
    assert 0 <= min(e.depth for e in ex[200]) and max(e.depth for e in ex[200]) <= 1
    again = make_examples(TOK, [64, 200], samples=5, seed=1, value_digits=2, keys=KEYS)
    assert [e.prompt_ids for e in again[200]] == [e.prompt_ids for e in ex[200]]


@pytest.mark.parametrize("method", ["generate", "rank"])
def test_oracle_scores_one_and_constant_model_scores_zero(method):
    ex = make_examples(TOK, [64, 256], samples=6, seed=2, value_digits=2, keys=KEYS)

    def always_eos(ids):
        return torch.nn.functional.one_hot(torch.ones_like(ids), V).float()

    res = run_probe({"teacher": recall_oracle, "student": always_eos}, ex, method=method, progress=False)
    assert res["accuracy"]["teacher"] == {"64": 1.0, "256": 1.0}
    if method == "generate":
        assert res["accuracy"]["student"] == {"64": 0.0, "256": 0.0}
    else:  # every candidate scores the same: the first is chosen, right only where it is the answer
        first = {str(L): sum(e.gold == 0 for e in exs) / len(exs) for L, exs in ex.items()}
        assert res["accuracy"]["student"] == first and set(first.values()) != {1.0}
    assert len(res["per_sample"]["teacher"]["256"]) == 6


@torch.no_grad()
def test_real_tiny_model_with_hf_generate(tmp_path):
    """HF generate with its cache decodes what a full forward per token decodes (several tokens),
    and an example counts as correct exactly when those tokens are its answer."""
    path = save_hf(tmp_path / "m", tiny_llama(V, seed=5), TOK)
    loaded = load_model(path)
    ex = make_examples(TOK, [128], samples=4, seed=3, value_digits=2, keys=KEYS)
    for e in ex[128]:
        ids = torch.tensor([e.prompt_ids])
        want = ids
        for _ in range(6):
            want = torch.cat([want, loaded.forward(want)[:, -1:].argmax(-1)], dim=1)
        assert loaded.generate(ids, 6).tolist() == want[:, ids.shape[1]:].tolist()
        assert greedy_generate(loaded.forward, ids, 6).tolist() == want[:, ids.shape[1]:].tolist()
    res = run_probe({"student": loaded}, ex, method="generate", progress=False)
    res_nocache = run_probe({"student": loaded.forward}, ex, method="generate", progress=False)
    assert res_nocache == res
    decoded = [greedy_generate(loaded.forward, torch.tensor([e.prompt_ids]), len(e.answer_ids))[0].tolist()
               for e in ex[128]]
    assert [s["correct"] for s in res["per_sample"]["student"]["128"]] == \
        [d == e.answer_ids for d, e in zip(decoded, ex[128])]


def test_the_command_line_names_a_missing_model_or_bad_lengths_in_one_error_line(tmp_path):
    from megatron_tc.eval.long_context import main

    with pytest.raises(SystemExit, match=r"^error: model path .*none' does not exist; give an HF directory"):
        main(["--model", str(tmp_path / "none"), "--lengths", "64"])
    with pytest.raises(SystemExit, match=r"^error: --lengths '6x4': give comma-separated token counts"):
        main(["--model", str(tmp_path / "none"), "--lengths", "6x4"])


def test_the_command_line_writes_json_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_tc.eval.long_context import main

    path = save_hf(tmp_path / "m", tiny_llama(V, seed=5), TOK)
    out = tmp_path / "long_context.json"
    assert main(["--model", str(path), "--teacher", str(path), "--lengths", "64,128", "--samples", "2",
                 "--value-digits", "2", "--device", "cpu", "--dtype", "float32", "--no-progress",
                 "--out", str(out), "--tb", str(tmp_path / "tb")]) == 0
    result = json.loads(out.read_text())
    assert result["lengths"] == [64, 128] and set(result["accuracy"]) == {"teacher", "student"}
    assert result["accuracy"]["teacher"] == result["accuracy"]["student"]  # the same model twice
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for name, accuracy in result["accuracy"].items():
        assert [(e.step, e.value) for e in events.Scalars(f"long_context/{name}/accuracy")] == \
            [(int(L), pytest.approx(a)) for L, a in accuracy.items()]
