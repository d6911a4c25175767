"""lm-evaluation-harness adapter on a local multiple-choice task (offline, through the real harness path)."""
import json
import random

import pytest
import torch

from megatron_tc.eval.harness import MegatronTCLM, run_tasks
from megatron_tc.eval.loading import load_model
from megatron_tc.eval.tiny import save_hf, tiny_llama, word_tokenizer

WORDS = [f"w{i}" for i in range(30)]
TASK = "tc_local_mc"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A 12-question task: the context is one word, the gold choice repeats it, 3 distractors."""
    root = tmp_path_factory.mktemp("harness")
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as fh:
        for _ in range(12):
            words = rng.sample(WORDS, 4)
            gold = rng.randrange(4)
            fh.write(json.dumps({"query": words[gold], "choices": words, "gold": gold}) + "\n")
    (root / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'data.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


def _acc(results):
    return results[TASK]["acc,none"]


def repeat_model(input_ids):
    """Predicts that the next token repeats the current one: the gold choice always wins."""
    return 20.0 * torch.nn.functional.one_hot(input_ids, len(WORDS) + 2).float()


def test_always_right_model_scores_one(task_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    lm = MegatronTCLM(model=repeat_model, tokenizer=word_tokenizer(WORDS), device="cpu", batch_size=5)
    assert _acc(run_tasks(lm, [TASK], include_path=task_dir, include_defaults=False)) == 1.0


def test_real_tiny_model_from_path_matches_hf_backend(task_dir, monkeypatch, tmp_path):
    """Registered name + HF dir; accuracy in [0, 1] and equal to lm_eval's own HF backend."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model_dir = save_hf(tmp_path / "m", tiny_llama(len(WORDS) + 2, seed=3), word_tokenizer(WORDS))
    manager = TaskManager(include_path=task_dir, include_defaults=False)
    got = lm_eval.simple_evaluate(model="megatron_tc", model_args=f"pretrained={model_dir},batch_size=4",
                                   tasks=[TASK], task_manager=manager, bootstrap_iters=0, log_samples=True)
    loaded = load_model(model_dir)
    ref = lm_eval.simple_evaluate(model=HFLM(pretrained=loaded.module, tokenizer=loaded.tokenizer, batch_size=4),
                                  tasks=[TASK], task_manager=manager, bootstrap_iters=0, log_samples=True)
    acc = _acc(got["results"])
    assert 0.0 <= acc <= 1.0 and acc == _acc(ref["results"])
    ll_got = [r[0][0] for s in got["samples"][TASK] for r in [s["resps"][0]] + s["resps"][1:]]
    ll_ref = [r[0][0] for s in ref["samples"][TASK] for r in [s["resps"][0]] + s["resps"][1:]]
    assert ll_got == pytest.approx(ll_ref, rel=1e-5)


def test_rolling_loglikelihood_equals_sum_over_disjoint_windows():
    """loglikelihood_rolling over a long document with a small max_length equals one direct pass."""
    from lm_eval.api.instance import Instance

    tok = word_tokenizer(WORDS)
    model = tiny_llama(len(WORDS) + 2, seed=4).double()

    def fwd(ids):
        return model(input_ids=ids).logits

    doc = " ".join(random.Random(1).choice(WORDS) for _ in range(23))
    lm = MegatronTCLM(model=fwd, tokenizer=tok, device="cpu", max_length=8)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True)
    ids = [tok.eos_token_id] + tok(doc, add_special_tokens=False)["input_ids"]
    want = 0.0
    for start in range(0, 23, 8):  # disjoint windows of 8 predictions, each conditioned on its own inputs
        window = torch.tensor([ids[start:start + 9]])
        with torch.no_grad():
            lp = fwd(window[:, :-1]).log_softmax(-1)
        want += lp[0].gather(-1, window[0, 1:, None]).sum().item()
    assert got == pytest.approx(want, rel=1e-6)
