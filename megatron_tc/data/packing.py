"""Packing tokenized documents into fixed-length training sequences that keep document boundaries.

The documents of a split are tokenized, each followed by EOS, and concatenated into one token
stream. Sequence i covers the stream window [i*T, i*T + T + 1): inputs are its first T tokens and
the label of input t is token t+1 of the window (windows overlap by one token, as in Megatron-LM).
Labels are already shifted: the loss is `cross_entropy(logits[:, t], labels[:, t])` position by
position, with no further shift (unlike HF models' `labels=` argument). Mask KL and hidden-state
losses with `labels != IGNORE_INDEX` as well, which also excludes padding.

Boundary rules (the model masks attention across documents and resets the GDN state where
`doc_ids` changes):

* `labels[t] = -100` where token t+1 belongs to another document: predicting the next document's
  first token from the previous document (i.e. after its EOS) is meaningless. The token before EOS
  does predict EOS, so the student learns where documents end.
* A document longer than T is split across sequences. Each continuation starts a new segment of
  its sequence (`doc_ids` 0, `position_ids` from 0, fresh GDN state): sequences are independent
  samples that are shuffled, so state cannot flow from one to the next. The last input of a window
  keeps its label (the next token of the same document), so only first tokens of documents are
  never predicted.
* Short documents are packed together: `doc_ids` counts documents within the sequence from 0, and
  `position_ids` restart at 0 at every document start.
* With `drop_last=False` (evaluation) the tail of the stream becomes a final sequence padded with
  `pad_id`; padding is its own segment (next doc id) with labels -100.

With a BOS id (`megatron_tc.data.bos`: the teacher's tokenizer adds BOS), every sequence starts with
BOS, as the teacher was trained: sequence i is BOS followed by the T-1 stream tokens
[i*(T-1), i*(T-1) + T-1), which are its targets, each predicted once (the first from BOS, in the
same segment as it, at position 0); the BOS itself is never a target, and the last input has no
label (its next token opens the next sequence). A sequence whose first token already is its
document's BOS starts with that one instead of a second, and takes one more stream token as
context only (no label) in the freed slot. Without a BOS id nothing of the above applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_tc.model.ops.masks import positions_from_doc_ids

IGNORE_INDEX = -100


@dataclass
class TokenStream:
    """tokens: int32 [L], every document followed by EOS; offsets: int64 [D+1], document d is
    tokens[offsets[d]:offsets[d+1]]."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError("offsets must start at 0 and end at len(tokens)")
        if np.any(np.diff(self.offsets) <= 0):
            raise ValueError("every document must hold at least one token (its EOS)")

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_token_lists(cls, docs: list[list[int]] | list[np.ndarray]) -> "TokenStream":
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([np.asarray(d, dtype=np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        return cls(tokens=tokens, offsets=offsets)


def num_sequences(stream_len: int, seq_len: int, drop_last: bool, bos: bool = False) -> int:
    """Sequences of `seq_len` inputs (+1 label token) from a stream of `stream_len` tokens; with
    `bos`, of BOS + seq_len - 1 stream tokens (every stream token is a target)."""
    if bos:
        per = seq_len - 1
        return stream_len // per if drop_last else -(-stream_len // per)
    usable = max(stream_len - 1, 0)  # the final token is never an input with a label
    return usable // seq_len if drop_last else -(-usable // seq_len)


def sequence_start(index: int, seq_len: int, bos: bool = False) -> int:
    """Stream position of sequence `index`'s first token (after the BOS, with one)."""
    return index * (seq_len - 1 if bos else seq_len)


def pack_window(stream: TokenStream, start: int, seq_len: int, pad_id: int,
                bos_id: int | None = None) -> dict[str, np.ndarray]:
    """One sequence starting at stream position `start`; returns int64 arrays of shape [T]:
    input_ids, labels, doc_ids, position_ids. With `bos_id`, BOS opens it (module doc)."""
    if bos_id is not None:
        return _pack_bos_window(stream, start, seq_len, pad_id, bos_id)
    T = seq_len
    end = min(start + T + 1, len(stream.tokens))
    window = np.asarray(stream.tokens[start:end], dtype=np.int64)
    n = min(T, len(window) - 1)  # real inputs in this sequence
    doc = np.searchsorted(stream.offsets, np.arange(start, end), side="right") - 1
    out = {
        "input_ids": np.full(T, pad_id, np.int64),
        "labels": np.full(T, IGNORE_INDEX, np.int64),
        "doc_ids": np.empty(T, np.int64),
        "position_ids": np.empty(T, np.int64),
    }
    out["input_ids"][:n] = window[:n]
    same_doc = doc[:n] == doc[1 : n + 1]
    out["labels"][:n] = np.where(same_doc, window[1 : n + 1], IGNORE_INDEX)
    out["doc_ids"][:n] = doc[:n] - doc[0]  # documents are contiguous in the stream
    segment_start = np.maximum(stream.offsets[doc[:n]], start)
    out["position_ids"][:n] = np.arange(start, start + n) - segment_start
    if n < T:  # padding: a segment of its own
        out["doc_ids"][n:] = out["doc_ids"][n - 1] + 1 if n > 0 else 0
        out["position_ids"][n:] = np.arange(T - n)
    return out


def _pack_bos_window(stream: TokenStream, start: int, T: int, pad_id: int, bos_id: int) -> dict[str, np.ndarray]:
    """pack_window with BOS: BOS + stream[start : start + T - 1], or stream[start : start + T] when
    stream[start] is its document's own BOS (the last input then context only); see the module doc."""
    tokens, offsets, L = stream.tokens, stream.offsets, len(stream.tokens)
    own_end = min(start + T - 1, L)  # this sequence's targets are the stream tokens [start, own_end)
    first_doc = int(np.searchsorted(offsets, start, side="right")) - 1
    has_own_bos = start == offsets[first_doc] and int(tokens[start]) == bos_id
    prefix = 0 if has_own_bos else 1
    src = np.arange(start, min(start + T - prefix, L))  # stream positions of the inputs after the prefix
    doc = np.searchsorted(offsets, src, side="right") - 1
    nxt = np.minimum(src + 1, L - 1)
    has_label = (src + 1 < own_end) & (np.searchsorted(offsets, nxt, side="right") - 1 == doc)
    n = prefix + len(src)
    out = {
        "input_ids": np.full(T, pad_id, np.int64),
        "labels": np.full(T, IGNORE_INDEX, np.int64),
        "doc_ids": np.empty(T, np.int64),
        "position_ids": np.empty(T, np.int64),
    }
    out["input_ids"][prefix:n] = tokens[src]
    out["labels"][prefix:n] = np.where(has_label, tokens[nxt], IGNORE_INDEX)
    out["doc_ids"][prefix:n] = doc - doc[0]
    in_first = doc == doc[0]
    segment_start = np.maximum(offsets[doc], start)
    out["position_ids"][prefix:n] = src - segment_start + np.where(in_first, prefix, 0)
    if prefix:  # the BOS joins the first token's segment and predicts it
        out["input_ids"][0], out["labels"][0] = bos_id, tokens[start]
        out["doc_ids"][0] = out["position_ids"][0] = 0
    if n < T:  # padding: a segment of its own
        out["doc_ids"][n:] = out["doc_ids"][n - 1] + 1
        out["position_ids"][n:] = np.arange(T - n)
    return out


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length sequences over a token stream; item i is a dict of int64 tensors [T].
    `bos_id`: every sequence starts with BOS (module doc); None: no BOS is added."""

    def __init__(self, stream: TokenStream, seq_len: int, pad_id: int, drop_last: bool = True,
                 fingerprint: str = "", bos_id: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if bos_id is not None and seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 when sequences start with BOS (BOS + one token), got {seq_len}")
        self.stream, self.seq_len, self.pad_id, self.drop_last = stream, seq_len, pad_id, drop_last
        self.bos_id = bos_id
        self.fingerprint = f"{fingerprint}:T{seq_len}:{'drop' if drop_last else 'pad'}"
        if bos_id is not None:
            self.fingerprint += f":bos{bos_id}"
        self._n = num_sequences(len(stream.tokens), seq_len, drop_last, bos=bos_id is not None)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self._n:
            raise IndexError(f"sequence {i} out of range ({self._n} sequences)")
        start = sequence_start(i, self.seq_len, self.bos_id is not None)
        window = pack_window(self.stream, start, self.seq_len, self.pad_id, self.bos_id)
        return {k: torch.from_numpy(v) for k, v in window.items()}

    def batch(self, indices: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Stacked sequences: dict of int64 tensors [B, T]."""
        items = [self[int(i)] for i in indices]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    def num_label_tokens(self) -> int:
        """Tokens that carry a label (what a perplexity is averaged over)."""
        return sum(int((self[i]["labels"] != IGNORE_INDEX).sum()) for i in range(self._n))


def attention_mask_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] -> bool [B, T, T]: query t may attend key s iff s <= t and same document.
    A reference for tests; kernels should derive the mask blockwise instead of materializing it."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return same & causal


def position_ids_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] (non-decreasing per row) -> position_ids [B, T] restarting at each document
    (the model's own rule, so packed data and the model never disagree)."""
    return positions_from_doc_ids(doc_ids)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] -> bool [B, T], True at the first token of every segment (GDN state reset)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts
