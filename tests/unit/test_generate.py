"""Decoding with the cache equals full forward passes, for a hybrid with sliding-window attention,
global attention and GDN layers (with and without short convs)."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, HybridCache, HybridLM, generate, sample_next


def hybrid(conv: int = 4) -> HybridLM:
    arch = ArchConfig(
        family="gemma3", vocab_size=97, padded_vocab_size=128, hidden_size=64, num_layers=5, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, layer_pattern="AGAGG", sliding_window=5,
        attn_layer_types=["sliding", "full", "full", "sliding", "full"], rope_local_theta=100.0, qk_norm=True,
        norm_unit_offset=True, sandwich_norm=True, embed_scale=8.0, gdn_conv_size=conv, gdn_chunk_size=8,
        gdn_expand_kv=conv == 0, mlp_activation="gelu_tanh",
    )
    torch.manual_seed(0)
    model = HybridLM(arch).eval()
    with torch.no_grad():  # lively gates so GDN layers matter
        for layer in model.layers:
            if layer.kind == "G":
                layer.mixer.A_log.fill_(-1.0)
    return model


@pytest.mark.parametrize("conv", [0, 4], ids=["no_conv", "conv4"])
def test_cached_steps_equal_full_forward(conv):
    """Prefill 9 tokens, then chunks of 1, 3 and 20 tokens: logits equal one full forward."""
    model = hybrid(conv)
    ids = torch.randint(0, 97, (2, 9 + 1 + 3 + 20 + 1 + 1))
    with torch.no_grad():
        full = model(ids)
        cache = HybridCache(model.arch)
        pieces, start = [], 0
        for size in (9, 1, 3, 20, 1, 1):
            pieces.append(model(ids[:, start : start + size], cache=cache))
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)
    assert cache.seen_tokens == ids.shape[1]
    assert cache.layer(0).k.shape[2] == 4  # sliding layer keeps window - 1 keys
    assert cache.layer(2).k.shape[2] == ids.shape[1]
    assert cache.layer(1).state.shape == (2, 4, 16, 16)


def test_greedy_generate_equals_argmax_of_full_forward():
    model = hybrid()
    prompt = torch.randint(0, 97, (2, 7))
    out = generate(model, prompt, max_new_tokens=12)
    assert out.shape == (2, 19) and torch.equal(out[:, :7], prompt)
    with torch.no_grad():
        full = model(out)
    assert torch.equal(full[:, 6:-1].argmax(-1), out[:, 7:])


def test_sampling_options():
    model = hybrid()
    prompt = torch.randint(0, 97, (2, 5))
    greedy = generate(model, prompt, 6)
    assert torch.equal(generate(model, prompt, 6, do_sample=True, top_k=1), greedy)
    assert torch.equal(generate(model, prompt, 6, do_sample=True, top_p=1e-6), greedy)
    a = generate(model, prompt, 6, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 6, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.9]])
    draws = {sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(s)).item() for s in range(40)}
    assert draws == {2, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)


def test_eos_stops_rows():
    model = hybrid()
    prompt = torch.randint(0, 97, (1, 5))
    first = generate(model, prompt, 1)[0, -1].item()
    out = generate(model, prompt, 10, eos_token_id=first)
    assert out.shape == (1, 6)


def test_doc_ids_with_cache_rejected():
    model = hybrid()
    ids = torch.randint(0, 97, (1, 6))
    with pytest.raises(ValueError, match="doc_ids"):
        model(ids, doc_ids=torch.zeros_like(ids), cache=HybridCache(model.arch))
