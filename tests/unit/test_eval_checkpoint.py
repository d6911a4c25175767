"""Evaluating a megatron_tc checkpoint (hybrid HybridLM) through load_model, and cached generation."""
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_tc.convert import checkpoint
from megatron_tc.eval.loading import detect_kind, greedy_generate, load_model
from megatron_tc.eval.perplexity import evaluate_windows, make_windows
from megatron_tc.eval.tiny import word_tokenizer
from megatron_tc.model import ArchConfig, HybridLM

WORDS = [f"w{i}" for i in range(50)]


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    arch = ArchConfig(family="llama", vocab_size=len(WORDS) + 2, hidden_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64, layer_pattern="AGG")
    torch.manual_seed(0)
    model = HybridLM(arch).eval()
    tok_dir = root / "tok"
    word_tokenizer(WORDS).save_pretrained(tok_dir)
    files = {name: (tok_dir / name).read_bytes() for name in os.listdir(tok_dir)}
    path = checkpoint.save_checkpoint(model.state_dict(), arch, root / "ckpt", tokenizer_files=files)
    return str(path), model


def test_checkpoint_perplexity_equals_direct_forward(hybrid_ckpt):
    path, reference = hybrid_ckpt
    assert detect_kind(path)[0] == "megatron_tc"
    loaded = load_model(path, dtype="float64")
    ids = loaded.tokenizer(" ".join(WORDS[i % 50] for i in range(0, 700, 7)), add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids)
    res = evaluate_windows(loaded, make_windows(ids, 32), batch_size=2, progress=False)
    ref = reference.double()
    nll, n = 0.0, 0
    for w in make_windows(ids, 32):
        for row in w:
            with torch.no_grad():
                nll += F.cross_entropy(ref(row[None])[0, :-1], row[1:], reduction="sum").item()
            n += row.numel() - 1
    reference.float()
    assert res.tokens == n
    assert res.nll == pytest.approx(nll / n, rel=1e-12)


def test_cached_greedy_generation_equals_full_forward(hybrid_ckpt):
    loaded = load_model(hybrid_ckpt[0])
    prompt = torch.randint(2, 52, (1, 37))
    assert torch.equal(loaded.generate(prompt, 6), greedy_generate(loaded.forward, prompt, 6))
