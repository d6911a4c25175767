"""lm-evaluation-harness on local tasks (offline, through the real harness path): HFLM over our models,
batched generation of an exported student, and the logits-callable adapter."""
import json
import random

import pytest
import torch

from megatron_tc.eval.harness import LogitsLM, MegatronTCHFLM, adds_bos, run_tasks
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
    lm = LogitsLM(model=repeat_model, tokenizer=word_tokenizer(WORDS), batch_size=5)
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
    lm = LogitsLM(model=fwd, tokenizer=tok, max_length=8)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True)
    ids = [tok.eos_token_id] + tok(doc, add_special_tokens=False)["input_ids"]
    want = 0.0
    for start in range(0, 23, 8):  # disjoint windows of 8 predictions, each conditioned on its own inputs
        window = torch.tensor([ids[start:start + 9]])
        with torch.no_grad():
            lp = fwd(window[:, :-1]).log_softmax(-1)
        want += lp[0].gather(-1, window[0, 1:, None]).sum().item()
    assert got == pytest.approx(want, rel=1e-6)


GEN_TASK = "tc_local_gen"


@pytest.fixture(scope="module")
def gen_task_dir(tmp_path_factory):
    """Generation: contexts of 1-5 words (so a batch is left-padded), 3 new tokens."""
    root = tmp_path_factory.mktemp("gen_task")
    rng = random.Random(2)
    with open(root / "data.jsonl", "w") as fh:
        for _ in range(10):
            fh.write(json.dumps({"query": " ".join(rng.choices(WORDS, k=rng.randint(1, 5))), "answer": "w1"}) + "\n")
    (root / f"{GEN_TASK}.yaml").write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'data.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<unk>"]
  max_gen_toks: 3
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


@pytest.fixture(scope="module")
def student_ckpt(tmp_path_factory):
    from megatron_tc.convert import checkpoint as ckpt
    from megatron_tc.model import ArchConfig, HybridLM

    torch.manual_seed(0)
    arch = ArchConfig(family="llama", vocab_size=len(WORDS) + 2, hidden_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64, layer_pattern="GAG", gdn_conv_size=3,
                      tie_embeddings=True)
    model = HybridLM(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return ckpt.save_checkpoint(model.state_dict(), arch, tmp_path_factory.mktemp("ck") / "ck", 1, 1,
                                source={"hf_config": {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 1}})


def _responses(out, task):
    return [s["resps"][0][0] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def test_student_checkpoint_generates_batched_like_one_by_one(student_ckpt, gen_task_dir, monkeypatch, tmp_path):
    """HFLM's batched, left-padded generation of a hybrid student equals generating each request alone."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    manager = TaskManager(include_path=gen_task_dir, include_defaults=False)
    texts = {}
    for batch in (1, 4):
        lm = MegatronTCHFLM(pretrained=str(student_ckpt), tokenizer=word_tokenizer(WORDS), device="cpu",
                            batch_size=batch)
        out = lm_eval.simple_evaluate(model=lm, tasks=[GEN_TASK], task_manager=manager, bootstrap_iters=0,
                                      log_samples=True)
        texts[batch] = _responses(out, GEN_TASK)
    assert texts[1] == texts[4]
    assert any(t.strip() for t in texts[1]), texts[1]


def test_student_checkpoint_scores_as_its_export_on_stock_hflm(student_ckpt, task_dir, monkeypatch, tmp_path):
    """A checkpoint through "megatron_tc" scores as its exported directory through lm_eval's own HF backend."""
    import lm_eval
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from megatron_tc.convert.export import export_to_hf

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    tok = word_tokenizer(WORDS)
    manager = TaskManager(include_path=task_dir, include_defaults=False)
    got = lm_eval.simple_evaluate(model=MegatronTCHFLM(pretrained=str(student_ckpt), tokenizer=tok, batch_size=3),
                                   tasks=[TASK], task_manager=manager, bootstrap_iters=0, log_samples=True)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export_to_hf(student_ckpt, tmp_path / "hf"),
                                                                 trust_remote_code=True, dtype=torch.float32)
    ref = lm_eval.simple_evaluate(model=HFLM(pretrained=exported, tokenizer=tok, batch_size=3, device="cpu",
                                             add_bos_token=adds_bos(tok)),
                                  tasks=[TASK], task_manager=manager, bootstrap_iters=0, log_samples=True)
    ll = lambda out: [r[0][0] for s in out["samples"][TASK] for r in s["resps"]]  # noqa: E731
    assert ll(got) == pytest.approx(ll(ref), rel=1e-5)
    assert _acc(got["results"]) == _acc(ref["results"])


def test_bos_rule_follows_the_tokenizer():
    from tokenizers import processors

    plain = word_tokenizer(WORDS)
    assert adds_bos(plain) is False
    with_bos = word_tokenizer(WORDS)  # a Llama-style post-processor: BOS before every text
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", with_bos.bos_token_id)])
    assert with_bos("w1")["input_ids"][0] == with_bos.bos_token_id and adds_bos(with_bos) is True
    assert MegatronTCHFLM(pretrained=tiny_llama(len(WORDS) + 2), tokenizer=with_bos, device="cpu").add_bos_token


def test_the_command_line_names_a_missing_model_in_one_error_line(tmp_path):
    from megatron_tc.eval.harness import main

    with pytest.raises(SystemExit, match=r"^error: --model .*none: model path .* does not exist"):
        main(["--model", str(tmp_path / "none"), "--tasks", "hellaswag", "--device", "cpu"])
