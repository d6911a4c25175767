"""StaticDecoder (megatron_tc/bench/static_decode.py): the same logits and tokens as the model's
own cached decoding, on CPU (the CUDA-graph capture itself runs in tools/bench/inference.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_tc.bench.models import tiny
from megatron_tc.bench.static_decode import StaticDecoder
from megatron_tc.model import HybridCache, HybridLM


def prefilled(model: HybridLM, ids: torch.Tensor) -> HybridCache:
    cache = HybridCache(model.arch)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("pattern,conv", [("GAGA", 0), ("GGGA", 4), ("AAAA", 0)])
def test_static_steps_match_cached_decoding(pattern, conv):
    torch.manual_seed(0)
    arch = tiny().with_pattern(pattern)
    arch = type(arch).from_dict({**arch.to_dict(), "gdn_conv_size": conv}) if conv else arch
    model = HybridLM(arch).eval()
    ids = torch.randint(0, arch.vocab_size, (2, 24))
    ref_cache = prefilled(model, ids[:, :20])
    decoder = StaticDecoder(model, copy.deepcopy(ref_cache), capacity=32)
    for i in range(20, 24):  # teacher-forced steps: the same input token on both paths
        with torch.no_grad():
            ref = model(ids[:, i:i + 1], cache=ref_cache)
        decoder.token.copy_(ids[:, i:i + 1])
        out = decoder.step()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert int(decoder.length) == 24


def test_greedy_decode_matches_the_model_loop():
    torch.manual_seed(1)
    arch = tiny().with_pattern("GGGA")
    model = HybridLM(arch).eval()
    ids = torch.randint(0, arch.vocab_size, (2, 16))
    ref_cache = prefilled(model, ids)
    decoder = StaticDecoder(model, copy.deepcopy(ref_cache), capacity=24)
    token, expected = ids[:, -1:], []
    with torch.no_grad():
        for _ in range(6):
            token = model(token, cache=ref_cache)[:, -1].argmax(-1, keepdim=True)
            expected.append(token)
    assert torch.equal(decoder.decode(ids[:, -1:], 6), torch.cat(expected, dim=1))
    with pytest.raises(ValueError, match="exceed the capacity 24"):
        decoder.decode(token, 3)


def test_capacity_must_exceed_the_prefill():
    model = HybridLM(tiny().with_pattern("GGGA")).eval()
    cache = prefilled(model, torch.randint(0, 256, (1, 8)))
    with pytest.raises(ValueError, match="capacity 8 must exceed the prefilled length 8"):
        StaticDecoder(model, cache, capacity=8)
