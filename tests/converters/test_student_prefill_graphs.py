"""The exported student's chunked prefill (graphs_megatron_tc.ChunkedPrefill) on CPU, its pieces
run eagerly instead of replayed: a prompt cut into power-of-two pieces over the scratch cache gives
the eager prefill's logits and leaves the caller's cache as the eager prefill does (decoding
continues identically), and the policy of `ChunkedPrefills` (built the second time a batch size
comes, reused for every length, rebuilt over replaced weights). Replayed graphs on CUDA:
tests/gpu/test_student_generate_cuda.py."""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_tc.convert.hf_student import MegatronTCCache, MegatronTCConfig, MegatronTCForCausalLM
from megatron_tc.export import graphs_megatron_tc as graphs
from tests.converters.helpers import tiny_arch


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 31, 4090, 4096, 5000])
def test_piece_lengths_are_powers_of_two_largest_first(tokens):
    pieces = graphs.piece_lengths(tokens, 2048)
    assert sum(pieces) == tokens
    assert all(p & (p - 1) == 0 and p <= 2048 for p in pieces)
    assert pieces == sorted(pieces, reverse=True)
    assert len(set(pieces) - {2048}) == len(pieces) - pieces.count(2048)  # one piece per smaller power


def test_piece_lengths_of_a_4k_prompt():
    assert graphs.piece_lengths(4090, 2048) == [2048, 1024, 512, 256, 128, 64, 32, 16, 8, 2]


def student(pattern: str = "AGGG", seed: int = 0) -> MegatronTCForCausalLM:
    torch.manual_seed(seed)
    return MegatronTCForCausalLM(MegatronTCConfig.from_arch(tiny_arch(pattern))).eval()


def eager_prefill(model, ids: torch.Tensor, static_len: int) -> tuple[torch.Tensor, MegatronTCCache]:
    cache = MegatronTCCache(model.config, static_len=static_len)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits, cache


def decode(model, cache: MegatronTCCache, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of feeding `tokens` [B, N] one at a time after the cached prompt."""
    return torch.cat([model(input_ids=tokens[:, i:i + 1], cache=cache, use_cache=True).logits
                      for i in range(tokens.shape[1])], 1)


@pytest.mark.parametrize("pattern", ["AGGG", "GAGA"])
@pytest.mark.parametrize("length", [2, 3, 23, 32])
def test_chunked_prefill_equals_the_eager_prefill_and_decoding_continues_alike(pattern, length):
    model = student(pattern)
    ids = torch.randint(3, 300, (2, length))
    follow = torch.randint(3, 300, (2, 4))
    with torch.no_grad():
        want, eager_cache = eager_prefill(model, ids, static_len=40)
        prefill = graphs.ChunkedPrefill(model, rows=2, capacity=33, graph=False)
        assert prefill.largest == 32
        cache = MegatronTCCache(model.config, static_len=40)
        got = prefill.run(ids, cache)
        cache.seen = length
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode(model, cache, follow), decode(model, eager_cache, follow),
                                   rtol=1e-5, atol=1e-5)


def test_a_second_prompt_starts_from_empty_states():
    """The scratch cache's GDN states and convolution inputs are zeroed per prompt: a prompt after
    another gives what it gives alone."""
    model = student()
    first, second = torch.randint(3, 300, (1, 19)), torch.randint(3, 300, (1, 11))
    with torch.no_grad():
        prefill = graphs.ChunkedPrefill(model, rows=1, capacity=24, graph=False)
        prefill.run(first, MegatronTCCache(model.config, static_len=24))
        got = prefill.run(second, MegatronTCCache(model.config, static_len=24))
        want, _ = eager_prefill(model, second, static_len=24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prompt_longer_than_the_callers_cache_is_refused():
    model = student()
    with torch.no_grad():
        prefill = graphs.ChunkedPrefill(model, rows=1, capacity=24, graph=False)
        with pytest.raises(ValueError, match="static cache holds 8 tokens"):
            prefill.run(torch.randint(3, 300, (1, 12)), MegatronTCCache(model.config, static_len=8))


def test_pieces_are_built_at_the_second_prefill_of_a_batch_size_and_serve_every_length(monkeypatch):
    built, chunked = [], graphs.ChunkedPrefill

    def eager_pieces(model, rows, capacity, pool):
        built.append((rows, capacity))
        return chunked(model, rows, capacity, pool, graph=False)

    monkeypatch.setattr(graphs, "ChunkedPrefill", eager_pieces)
    model = student()
    sets = graphs.ChunkedPrefills(keep=2)

    def prefill(ids):
        return sets.run(model, MegatronTCCache(model.config, static_len=64), ids, tokens=64)

    with torch.no_grad():
        assert prefill(torch.randint(3, 300, (2, 12))) is None  # the first of its batch size: eager
        ids = torch.randint(3, 300, (2, 9))
        got = prefill(ids)
        assert built == [(2, 32)]
        torch.testing.assert_close(got, eager_prefill(model, ids, 64)[0], rtol=1e-5, atol=1e-5)
        for length in (5, 17, 32):  # every later length of that batch size: the same pieces
            assert prefill(torch.randint(3, 300, (2, length))) is not None
        assert built == [(2, 32)]
        assert prefill(torch.randint(3, 300, (1, 40))) is None  # another batch size counts apart
        assert prefill(torch.randint(3, 300, (1, 40))) is not None and built[-1] == (1, 64)
        assert prefill(torch.randint(3, 300, (4, 8))) is None
        assert prefill(torch.randint(3, 300, (4, 8))) is not None
        assert list(sets.sets) == [1, 4], "the least recently used batch size was not dropped"
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        ids = torch.randint(3, 300, (4, 8))
        got = prefill(ids)
        assert built[-1] == (4, 16) and len(built) == 4, "pieces over replaced weights were replayed"
        torch.testing.assert_close(got, eager_prefill(model, ids, 64)[0], rtol=1e-5, atol=1e-5)


def test_capacity_too_small_for_the_prompt_runs_eagerly(monkeypatch):
    monkeypatch.setattr(graphs, "ChunkedPrefill", functools.partial(graphs.ChunkedPrefill, graph=False))
    model = student()
    sets = graphs.ChunkedPrefills()
    with torch.no_grad():
        for _ in range(3):
            assert sets.run(model, MegatronTCCache(model.config, static_len=64), torch.randint(3, 300, (2, 20)),
                            tokens=32) is None
    assert not sets.sets
