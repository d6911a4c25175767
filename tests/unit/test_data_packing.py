"""Packing keeps document boundaries: doc_ids, positions, labels, the attention mask and the
recurrent-state resets never mix two documents (property test over document lengths and seq_len)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tc.data import (
    IGNORE_INDEX,
    PackedSequences,
    TokenStream,
    attention_mask_from_doc_ids,
    document_starts,
    position_ids_from_doc_ids,
)

PAD = 999_999


def _stream(lengths: list[int]) -> TokenStream:
    # token value encodes (document, position in document): doc * 1000 + pos
    return TokenStream.from_token_lists([[d * 1000 + p for p in range(n)] for d, n in enumerate(lengths)])


def _doc(v: torch.Tensor) -> torch.Tensor:
    return v // 1000


def _pos(v: torch.Tensor) -> torch.Tensor:
    return v % 1000


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), seq_len=st.integers(1, 17),
       drop_last=st.booleans())
def test_packing_never_crosses_a_document_boundary(lengths, seq_len, drop_last):
    stream = _stream(lengths)
    ds = PackedSequences(stream, seq_len, pad_id=PAD, drop_last=drop_last)
    total, T = len(stream.tokens), seq_len
    N = (total - 1) // T if drop_last else -(-(total - 1) // T)
    assert len(ds) == N
    if N == 0:
        return
    b = ds.batch(range(N))
    x, lab, doc_ids, pos = (b[k] for k in ("input_ids", "labels", "doc_ids", "position_ids"))
    real = x != PAD
    n_real = int(real.sum())
    # inputs are the stream in order; padding only at the end of the last sequence
    assert torch.equal(x[real], torch.as_tensor(stream.tokens[:n_real], dtype=torch.long))
    assert bool(real.flatten()[:n_real].all())
    # doc_ids: 0 at each sequence start, +1 exactly where the source document changes (padding too)
    src = torch.where(real, _doc(x), torch.full_like(x, -1))
    assert bool((doc_ids[:, 0] == 0).all())
    assert torch.equal(doc_ids[:, 1:] - doc_ids[:, :-1], (src[:, 1:] != src[:, :-1]).long())
    # positions: distance to the segment start, which is the within-document position minus that
    # of the segment's first token (a continued document restarts at 0)
    t = torch.arange(T).expand(N, T)
    starts = torch.ones_like(real)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    assert torch.equal(pos, t - start_idx)
    first_tok = x.gather(1, start_idx)
    assert torch.equal(pos[real], (_pos(x) - _pos(first_tok))[real])
    assert torch.equal(position_ids_from_doc_ids(doc_ids), pos)
    assert torch.equal(document_starts(doc_ids), starts)
    # labels: the next stream token if it is in the same document, else ignored
    nxt_idx = (torch.arange(N)[:, None] * T + torch.arange(T)[None, :] + 1).clamp(max=total - 1)
    nxt = torch.as_tensor(stream.tokens, dtype=torch.long)[nxt_idx]
    want = torch.where(real & (_doc(nxt) == src), nxt, torch.full_like(nxt, IGNORE_INDEX))
    assert torch.equal(lab, want)
    # the attention mask: causal and within one source document (padding: its own block)
    mask = attention_mask_from_doc_ids(doc_ids)
    same = (src[:, :, None] == src[:, None, :]) & (real[:, :, None] == real[:, None, :])
    assert torch.equal(mask, same & torch.ones(T, T, dtype=torch.bool).tril())
    # every token except document first tokens is predicted exactly once (all of them if padded)
    predicted = lab[lab != IGNORE_INDEX].tolist()
    targets = [d * 1000 + p for d, n in enumerate(lengths) for p in range(1, n)]
    if drop_last:
        assert len(predicted) == len(set(predicted)) and set(predicted) <= set(targets)
    else:
        assert sorted(predicted) == sorted(targets)


def _reset_scan(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """A decaying recurrent state h_t = 0.5 h_{t-1} + x_t, reset where `starts` (the GDN contract)."""
    h = torch.zeros(x.shape[0])
    out = []
    for t in range(x.shape[1]):
        h = torch.where(starts[:, t], torch.zeros_like(h), 0.5 * h) + x[:, t]
        out.append(h)
    return torch.stack(out, 1)


def test_recurrent_state_resets_match_per_document_runs():
    lengths = [5, 1, 9, 3, 14, 2]
    stream = _stream(lengths)
    ds = PackedSequences(stream, seq_len=8, pad_id=PAD, drop_last=False)
    b = ds.batch(range(len(ds)))
    vals = torch.where(b["input_ids"] == PAD, torch.zeros_like(b["input_ids"]), b["input_ids"]).double()
    packed = _reset_scan(vals, document_starts(b["doc_ids"]))
    for i in range(len(ds)):
        for seg in b["doc_ids"][i].unique():
            sel = b["doc_ids"][i] == seg
            alone = _reset_scan(vals[i][sel][None], torch.tensor([[True] + [False] * (int(sel.sum()) - 1)]))
            assert torch.allclose(packed[i][sel], alone[0])


def test_token_stream_rejects_bad_offsets():
    with pytest.raises(ValueError, match="at least one token"):
        TokenStream(tokens=np.zeros(3, np.int32), offsets=np.array([0, 0, 3]))
    with pytest.raises(ValueError, match="offsets"):
        TokenStream(tokens=np.zeros(3, np.int32), offsets=np.array([0, 2]))
