"""Decoding with the cache equals full forward passes, for a hybrid with sliding-window attention,
global attention and GDN layers (with and without short convs)."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, AttentionCache, HybridCache, HybridLM, generate, sample_next


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
    assert cache.layer(0).k.shape[2] == 5  # sliding layer: a ring of `window` keys
    assert cache.layer(2).k.shape[2] == ids.shape[1]
    assert cache.layer(1).state.shape == (2, 4, 16, 16)


@pytest.mark.parametrize("max_length", [None, 42], ids=["grow", "hint"])
def test_token_by_token_decoding_writes_in_place(max_length):
    """40 single-token steps after a 2-token prompt: logits equal one full forward; full-attention
    KV buffers are reallocated only O(log T) times without a hint and never with one; the
    sliding layer's ring stays at `window` slots."""
    model = hybrid()
    ids = torch.randint(0, 97, (2, 42))
    buffers = set()
    with torch.no_grad():
        full = model(ids)
        cache = HybridCache(model.arch, max_length=max_length)
        pieces = [model(ids[:, :2], cache=cache)]
        for i in range(2, 42):
            pieces.append(model(ids[:, i : i + 1], cache=cache))
            buffers.add(cache.layer(2).k.untyped_storage().data_ptr())
            assert cache.layer(0).k.shape[2] == min(i + 1, 5)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)
    assert cache.layer(2).k.shape[2] == 42
    assert len(buffers) == (1 if max_length else 5)  # capacities 2 -> 4 -> 8 -> 16 -> 32 -> 64
    ring = cache.layer(0)
    assert sorted(ring.index().tolist()) == list(range(37, 42))
    rows = torch.tensor([1])
    cache.reorder(rows)
    assert cache.layer(2).k.shape[:3] == (1, 2, 42) and cache.layer(0).k.shape[:3] == (1, 2, 5)


def test_snapshot_restore_undoes_in_place_steps():
    """A step taken after AttentionCache.snapshot() and undone by restore() leaves no trace: the
    next step equals decoding that token straight away (sliding ring already wrapped)."""
    model = hybrid()
    ids = torch.randint(0, 97, (1, 13))
    other = (ids[:, -1:] + 1) % 97
    with torch.no_grad():
        cache = HybridCache(model.arch)
        model(ids[:, :12], cache=cache)
        saved = [(e, e.snapshot() if isinstance(e, AttentionCache) else (e.state, dict(e.conv), e.seen))
                 for e in cache.layers]
        model(other, cache=cache)
        cache.seen_tokens -= 1
        for e, s in saved:
            if isinstance(e, AttentionCache):
                e.restore(s)
            else:
                e.state, e.conv, e.seen = s
        got = model(ids[:, 12:], cache=cache)
        want = model(ids)[:, -1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


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
