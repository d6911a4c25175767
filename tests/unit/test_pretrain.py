"""The pretrain stage (next-token objective, no teacher) through tools/distill.py: the held-out
perplexity falls, a run stopped and resumed ends with exactly the weights of an uninterrupted one,
the export is a plain Qwen2 HF model with the same logits as the megatron_tc checkpoint, and
tensor parallelism (TP=2 on 2 gloo ranks) trains as one process does."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from megatron_tc.data.synthetic import train_tiny_tokenizer, write_synthetic_corpus

    root = tmp_path_factory.mktemp("pretrain")
    tok = AutoTokenizer.from_pretrained(str(train_tiny_tokenizer(root / "tok", vocab_size=320)))
    write_synthetic_corpus(root / "text", n_docs=30, words_per_doc=(50, 200))
    config = {"model_type": "qwen2", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": True}
    (root / "qwen2.json").write_text(json.dumps(config))
    return root


def pretrain_args(assets: Path, run: Path, *extra: str) -> list[str]:
    """tools/distill.py's arguments: the pretrain stage of configs/tiny.yaml on `assets`."""
    return [str(ROOT / "configs" / "tiny.yaml"), "run.stages=[pretrain]",
            f"run.run_dir={run}", f"model.teacher={run / 'hf'}", f"data.tokenizer={assets / 'tok'}",
            f"data.source.paths=[{assets / 'text'}]", "data.source.split_by=file",
            f"pretrain.hf_config={assets / 'qwen2.json'}", "pretrain.steps=8", "pretrain.lr=1e-2",
            "pretrain.min_lr=1e-3", "pretrain.warmup_steps=1", "distill.eval_interval=4",
            "distill.checkpoint_interval=4", *extra]


def distill(assets: Path, run: Path, *extra: str, nproc: int = 1) -> str:
    """tools/distill.py's main on `nproc` gloo ranks of the test harness (fresh processes forked from
    its server: no launcher and no interpreter start-up per run); returns the ranks' output."""
    from megatron_tc.testing import run_distributed
    from tests._scripts import distill_main, rank_logs

    log = str(run.parent / f"{run.name}-{len(extra)}")
    run_distributed(distill_main, nproc, pretrain_args(assets, run, *extra), log, timeout=300)
    return rank_logs(log, nproc)


@pytest.fixture(scope="module")
def whole(assets, tmp_path_factory) -> Path:
    """An uninterrupted one-process run (both tests' reference; the run is deterministic):
    tools/distill.py's main on one gloo rank of the test harness."""
    from megatron_tc.testing import run_distributed
    from tests._scripts import distill_main

    run = tmp_path_factory.mktemp("whole") / "run"
    run_distributed(distill_main, 1, pretrain_args(assets, run), timeout=300)
    return run


def weights(run: Path) -> dict[str, torch.Tensor]:
    from megatron_tc.convert.checkpoint import load_checkpoint

    return load_checkpoint(run / "pretrain" / "model")[1]


def test_pretrain_learns_resumes_exactly_and_exports_the_family(assets, whole, tmp_path):
    split = tmp_path / "split"
    # the split run also evaluates at distill.eval_steps: scoring held-out text must not move training
    first = distill(assets, split, "--stop-after", "4", "distill.eval_steps=[1,2]")
    assert "pretrain stopped at step 4" in first
    second = distill(assets, split, "distill.eval_steps=[1,2]")
    assert "resumed at step 4" in second

    evals = [json.loads(line) for line in (whole / "pretrain" / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 4, 8]
    split_evals = [json.loads(line) for line in (split / "pretrain" / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in split_evals] == [0, 1, 2, 4, 8]
    assert evals[-1]["ppl"] < 0.5 * evals[0]["ppl"], evals  # from ~vocab-size perplexity at random init
    a, b = weights(whole), weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from transformers import AutoModelForCausalLM

    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    hf = AutoModelForCausalLM.from_pretrained(str(whole / "hf")).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM" and (whole / "hf" / "tokenizer.json").is_file()
    ids = torch.randint(3, 300, (1, 24))
    with torch.no_grad():
        diff = (hf(ids).logits - load_hybrid_lm(whole / "pretrain" / "model")(ids)).abs().max().item()
    assert diff < 1e-4


def test_pretrain_with_tensor_parallelism_trains_as_one_process(assets, whole, tmp_path):
    """TP=2 (megatron-core layers, vocabulary-parallel cross-entropy, ZeRO-3 through the TP mpu)
    against one process on the same data order: held-out perplexities within 1e-5 and the saved
    (gathered) weights all within 1e-5, each tensor within 2e-4 (TP sums in another order)."""
    from tests.parallel._workers_common import assert_close, assert_same_weights

    one, tp2 = whole, tmp_path / "tp2"
    out = distill(assets, tp2, "parallel.tp=2", nproc=2)
    shards = re.search(r"tensor-parallel over 2 ranks, (\d+) of (\d+) parameters", out)
    local, total = map(int, shards.groups())
    assert local < 0.6 * total, (local, total)  # this rank holds shards (norms and biases of KV heads stay whole)
    ppl = [[json.loads(line)["ppl"] for line in (run / "pretrain" / "eval_log.jsonl").read_text().splitlines()]
           for run in (tp2, one)]
    assert len(ppl[0]) == 3 and ppl[0][-1] < 0.5 * ppl[0][0], ppl
    assert_close(torch.tensor(ppl[0], dtype=torch.float64), torch.tensor(ppl[1], dtype=torch.float64),
                 "TP=2 vs one process held-out perplexity", 1e-5)
    assert_same_weights(weights(tp2), weights(one), "TP=2 vs one process pretrained weights")
