"""Perplexity / KL / top-1 agreement against direct computations, and the evaluate.py CLI."""
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_tc.eval.loading import ModelLoadError, load_model
from megatron_tc.eval.perplexity import EvalInputError, evaluate_text, make_windows, tokenize_file
from megatron_tc.eval.tiny import save_hf, tiny_llama, word_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = [f"w{i}" for i in range(40)] + [".", ","]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_ppl")
    tok = word_tokenizer(WORDS)
    student = save_hf(root / "student", tiny_llama(len(WORDS) + 2, seed=1), tok)
    teacher = save_hf(root / "teacher", tiny_llama(len(WORDS) + 2, seed=2), tok)
    rng = random.Random(0)
    text = root / "text.txt"
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) for _ in range(40)]
    text.write_text("\n".join(lines), encoding="utf-8")
    return {"student": student, "teacher": teacher, "text": str(text), "tok": tok}


def _direct(model_dir, text, tok, seq_len, max_tokens, teacher_dir=None):
    """Reference: one window at a time, cross-entropy and KL written out directly in fp64; returns
    (ppl, tokens, kl, top-1 agreement, the teacher's ppl)."""
    ids = tok(open(text, encoding="utf-8").read(), add_special_tokens=False)["input_ids"][:max_tokens]
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    t = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval() if teacher_dir else None
    nll, kl, agree, n, teacher_nll = 0.0, 0.0, 0, 0, 0.0
    for start in range(0, len(ids), seq_len):
        w = torch.tensor([ids[start:start + seq_len]])
        if w.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = m(w).logits[0, :-1]
            nll += F.cross_entropy(logits, w[0, 1:], reduction="sum").item()
            if t is not None:
                tl = t(w).logits[0, :-1]
                teacher_nll += F.cross_entropy(tl, w[0, 1:], reduction="sum").item()
                kl += F.kl_div(logits.log_softmax(-1), tl.log_softmax(-1), log_target=True,
                               reduction="sum").item()
                agree += int((logits.argmax(-1) == tl.argmax(-1)).sum())
        n += w.shape[1] - 1
    return math.exp(nll / n), n, kl / n, agree / n, math.exp(teacher_nll / n)


def test_windows_convention():
    ids = torch.arange(23)
    w = make_windows(ids, 10)
    assert [tuple(x.shape) for x in w] == [(2, 10), (1, 3)]
    assert torch.equal(torch.cat([x.flatten() for x in w]), ids)
    assert [tuple(x.shape) for x in make_windows(torch.arange(21), 10)] == [(2, 10)]  # 1-token tail dropped


def test_ppl_and_kl_equal_direct_computation_fp64(assets):
    seq_len, max_tokens = 16, 203  # 12 full windows + a tail of 11 tokens
    model = load_model(assets["student"], dtype="float64")
    teacher = load_model(assets["teacher"], dtype="float64")
    res = evaluate_text(model, assets["text"], model.tokenizer, seq_len, max_tokens, teacher=teacher,
                        batch_size=5, progress=False)
    ppl, n, kl, agree, teacher_ppl = _direct(assets["student"], assets["text"], assets["tok"], seq_len, max_tokens,
                                             assets["teacher"])
    assert res.tokens == n == max_tokens - 13
    assert res.windows == 13
    assert res.ppl == pytest.approx(ppl, rel=1e-12, abs=0)
    assert res.kl == pytest.approx(kl, rel=1e-10, abs=0)
    assert res.kl > 1e-3
    assert res.top1_agree == agree
    assert res.teacher_ppl == pytest.approx(teacher_ppl, rel=1e-12, abs=0)
    assert abs(res.teacher_ppl - res.ppl) > 1e-3 * res.ppl  # two models: the two perplexities differ


def test_kl_against_itself_is_zero(assets):
    model = load_model(assets["student"])
    res = evaluate_text(model, assets["text"], model.tokenizer, 32, 150, teacher=model, batch_size=2,
                        progress=False)
    assert res.kl == 0.0
    assert res.top1_agree == 1.0
    assert res.teacher_ppl == res.ppl


def test_batch_size_does_not_change_result(assets):
    model = load_model(assets["student"])
    a = evaluate_text(model, assets["text"], model.tokenizer, 16, 200, batch_size=1, progress=False)
    b = evaluate_text(model, assets["text"], model.tokenizer, 16, 200, batch_size=8, progress=False)
    assert a.tokens == b.tokens
    assert a.ppl == pytest.approx(b.ppl, rel=1e-6)


def test_bad_input_is_refused(assets, tmp_path):
    tok = assets["tok"]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("w1 w2 caf\xe9 w3".encode("latin-1"))
    with pytest.raises(EvalInputError, match="not UTF-8"):
        tokenize_file(bad, tok, 10)
    with pytest.raises(EvalInputError, match="does not exist"):
        tokenize_file(tmp_path / "missing.txt", tok, 10)
    with pytest.raises(EvalInputError, match="seq_len=1"):
        make_windows(torch.arange(5), 1)
    with pytest.raises(ModelLoadError, match="neither an HF directory"):
        load_model(tmp_path)


def test_cli_prints_json(assets, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--model", assets["student"],
           "--teacher", assets["teacher"], "--text", assets["text"], "--seq-len", "16", "--max-tokens", "100",
           "--json", "--batch-size", "3", "--tb", str(tmp_path / "tb")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    model, teacher = load_model(assets["student"]), load_model(assets["teacher"])
    ref = evaluate_text(model, assets["text"], model.tokenizer, 16, 100, teacher=teacher, progress=False)
    assert data["tokens"] == ref.tokens == 100 - 7
    for key in ("ppl", "kl", "top1_agree", "teacher_ppl"):
        assert data[key] == pytest.approx(getattr(ref, key), rel=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("ppl", "kl", "top1_agree", "teacher_ppl"):  # --tb: the same numbers
        assert [(e.step, e.value) for e in events.Scalars(f"eval/{key}")] == [(0, pytest.approx(data[key], rel=1e-6))]
    bad = subprocess.run(cmd[:2] + ["--model", "/nonexistent", "--text", assets["text"], "--seq-len", "8",
                                    "--max-tokens", "10", "--json"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
