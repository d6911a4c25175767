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
    total = len(stream.tokens)
    expected_n = (total - 1) // seq_len if drop_last else -(-(total - 1) // seq_len)
    assert len(ds) == expected_n
    predicted = []
    for i in range(len(ds)):
        s = ds[i]
        real = s["input_ids"] != PAD
        n = int(real.sum())
        x, lab, doc_ids, pos = (s[k] for k in ("input_ids", "labels", "doc_ids", "position_ids"))
        # inputs are the stream in order
        assert torch.equal(x[:n], torch.as_tensor(stream.tokens[i * seq_len : i * seq_len + n], dtype=torch.long))
        assert bool(real[:n].all()) and not bool(real[n:].any())
        # doc_ids: 0-based, +1 exactly where the source document changes, padding its own segment
        src = _doc(x[:n])
        assert doc_ids[0] == 0
        assert torch.equal(doc_ids[1:n] - doc_ids[: n - 1], (src[1:] != src[:-1]).long())
        if n < seq_len:
            assert bool((doc_ids[n:] == doc_ids[n - 1] + 1).all())
        # positions restart at every segment start; a continued document restarts at 0 too
        first_pos = {}
        for t in range(n):
            first_pos.setdefault(int(doc_ids[t]), int(_pos(x[t])))
            assert pos[t] == _pos(x[t]) - first_pos[int(doc_ids[t])]
        assert torch.equal(position_ids_from_doc_ids(doc_ids[None])[0], pos)
        # labels: the next token of the same document, else ignored
        nxt = torch.as_tensor(stream.tokens[i * seq_len + 1 : i * seq_len + n + 1], dtype=torch.long)
        same = _doc(nxt) == src
        assert torch.equal(lab[:n], torch.where(same, nxt, torch.full_like(nxt, IGNORE_INDEX)))
        assert bool((lab[n:] == IGNORE_INDEX).all())
        # the attention mask is causal and within one document of the stream
        mask = attention_mask_from_doc_ids(doc_ids[None])[0]
        full_doc = torch.cat([src, torch.full((seq_len - n,), -1)])
        ref = (full_doc[:, None] == full_doc[None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        ref[n:, n:] = torch.ones(seq_len - n, seq_len - n, dtype=torch.bool).tril()
        assert torch.equal(mask, ref)
        predicted += lab[lab != IGNORE_INDEX].tolist()
    # every token except document first tokens is predicted exactly once (all of them if padded)
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
