"""The pretrain stage (next-token objective, no teacher) through tools/distill.py: the held-out
perplexity falls, a run stopped and resumed ends with exactly the weights of an uninterrupted one,
and the export is a plain Qwen2 HF model with the same logits as the megatron_tc checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


def distill(assets: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "tools" / "distill.py"), "configs/tiny.yaml", "run.stages=[pretrain]",
           f"run.run_dir={run}", f"model.teacher={run / 'hf'}", f"data.tokenizer={assets / 'tok'}",
           f"data.source.paths=[{assets / 'text'}]", "data.source.split_by=file", f"pretrain.hf_config={assets / 'qwen2.json'}",
           "pretrain.steps=8", "pretrain.lr=1e-2", "pretrain.min_lr=1e-3", "pretrain.warmup_steps=1",
           "distill.eval_interval=4", "distill.checkpoint_interval=4", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def weights(run: Path) -> dict[str, torch.Tensor]:
    from megatron_tc.convert.checkpoint import load_checkpoint

    return load_checkpoint(run / "pretrain" / "model")[1]


def test_pretrain_learns_resumes_exactly_and_exports_the_family(assets, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    distill(assets, whole)
    first = distill(assets, split, "--stop-after", "4")
    assert "pretrain stopped at step 4" in first.stdout + first.stderr
    second = distill(assets, split)
    assert "resumed at step 4" in second.stdout + second.stderr

    evals = [json.loads(line) for line in (whole / "pretrain" / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 4, 8]
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
