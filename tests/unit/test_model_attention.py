"""Chunked attention probabilities equal the full softmax matrix; SDPA masking agrees with them."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, Attention, iter_attention_probs
from megatron_tc.model.ops.masks import positions_from_doc_ids


def full_probs(q, k, scale, window, doc_ids):
    """Reference: the whole [B, Hq, T, T] matrix with explicit loops over the mask."""
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    t = q.shape[2]
    for b in range(q.shape[0]):
        for i in range(t):
            for j in range(t):
                ok = j <= i and (window is None or i - j < window)
                ok = ok and (doc_ids is None or doc_ids[b, i] == doc_ids[b, j])
                if not ok:
                    scores[b, :, i, j] = float("-inf")
    return scores.softmax(-1)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_probs_equal_full_softmax(window, packed):
    arch = ArchConfig(family="mistral", vocab_size=10, hidden_size=48, num_layers=1, num_heads=6, num_kv_heads=2,
                      head_dim=8, intermediate_size=8, sliding_window=window)
    attn = Attention(arch, 0)
    x = torch.randn(2, 19, 48)
    doc_ids = torch.tensor([[0] * 8 + [1] * 11, [0] * 3 + [1] * 16]) if packed else None
    positions = positions_from_doc_ids(doc_ids) if packed else torch.arange(19).expand(2, 19)
    q, k, v = attn.project_qkv(x, positions)
    chunks = list(iter_attention_probs(q, k, attn.scale, window, doc_ids, chunk_size=5))
    assert [s for s, _ in chunks] == [0, 5, 10, 15] and chunks[-1][1].shape == (2, 6, 4, 19)
    probs = torch.cat([p for _, p in chunks], dim=2)
    torch.testing.assert_close(probs.double(), full_probs(q, k, attn.scale, window, doc_ids), rtol=1e-5, atol=1e-6)
    # The SDPA path must use the same mask: probs @ v reproduces the layer's attention output.
    index = torch.arange(19)
    sdpa = attn.attend(q, k, v, index, index, doc_ids)
    torch.testing.assert_close(probs @ v.repeat_interleave(3, 1), sdpa, rtol=1e-5, atol=1e-5)


def test_gqa_reads_kv_heads_without_expanding_them(monkeypatch):
    """attend() hands grouped K/V heads to SDPA (enable_gqa) instead of repeating them per query
    head, for the causal, the masked (packed) and the decoding (one query, all keys) calls, and
    gives what the explicit expansion gives."""
    arch = ArchConfig(family="llama", vocab_size=10, hidden_size=48, num_layers=1, num_heads=6, num_kv_heads=2,
                      head_dim=8, intermediate_size=8)
    attn = Attention(arch, 0)
    x, index = torch.randn(2, 11, 48), torch.arange(11)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    q, k, v = attn.project_qkv(x, positions_from_doc_ids(doc_ids))
    k6, v6 = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = (index[:, None] >= index[None]) & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    want = {"causal": sdpa(q, k6, v6, is_causal=True, scale=attn.scale),
            "packed": sdpa(q, k6, v6, attn_mask=mask, scale=attn.scale),
            "decode": sdpa(q[:, :, -1:], k6, v6, scale=attn.scale)}

    def no_copies(*args, **kwargs):
        raise AssertionError("K/V heads were expanded with repeat_interleave")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_copies)
    got = {"causal": attn.attend(q, k, v, index, index),
           "packed": attn.attend(q, k, v, index, index, doc_ids),
           "decode": attn.attend(q[:, :, -1:], k, v, index[-1:], index, all_visible=True)}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
