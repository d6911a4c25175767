"""Packed rows whose document layout for fla's variable-length kernels is computed once.

fla's chunked gated delta rule takes packed documents as segments of one flattened row:
`cu_seqlens` [S+1] (segment starts) and `chunk_indices` [NC, 2] (segment, chunk within it) for
every 64-token chunk. Derived from doc_ids on every call, they cost host reads (`nonzero`, fla's
`prepare_chunk_indices`) and their shapes follow the data, which a CUDA graph cannot replay.

`PackedRows.of(doc_ids)` derives them once, per row, in tables of one shape for all rows, so that
any selection of rows (`rows[index]`, a device index tensor) yields its flattened layout by
device gathers only, with shapes that depend on the number of rows alone. Every row is laid out
in a span of T + pad tokens holding exactly `n_chunks` chunks in `n_segments` segments:

    [its documents][pad tokens][zero-length segments]

The pad tokens (zeros: k = 0, beta = 0, g = 0 leave the state unchanged, q = 0 reads nothing)
are partly appended to the row's last document (which changes none of its outputs or its final
state, the rule being causal), partly single-token segments of their own, split so that the
row's chunk count is the common one. Zero-length segments own no chunk and only fill the
segment count up. Outputs of pad tokens are dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLA_CHUNK = 64  # the chunk length of fla's chunk_gated_delta_rule (its default)


def _doc_lengths(row: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal ids in `row` [T] (on the CPU)."""
    starts = [0] + ((row[1:] != row[:-1]).nonzero().squeeze(-1) + 1).tolist() + [row.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:])]


def _chunks(lengths: list[int]) -> int:
    return sum(-(-n // FLA_CHUNK) for n in lengths)


def _pad_split(last: int, pad: int, extra: int) -> int:
    """How many of `pad` tokens become single-token segments (the rest extend the last document,
    of length `last`) so that the pad adds exactly `extra` chunks."""
    for singles in range(pad + 1):
        added = singles + _chunks([last + pad - singles]) - _chunks([last])
        if added == extra:
            return singles
    raise AssertionError(f"no split of {pad} pad tokens adds {extra} chunks")  # ruled out by `of`


@dataclass(frozen=True)
class PackedRows:
    """Rows of packed documents with their fla layout. doc_ids [N, T]; starts [N, S+1] segment
    starts within a row's span of T + pad tokens; chunks [N, C, 2] (segment, chunk index within
    it) of the row's chunks in order; last [N] the segment of the row's last document (its final
    state is the row's)."""

    doc_ids: torch.Tensor
    starts: torch.Tensor
    chunks: torch.Tensor
    last: torch.Tensor
    pad: int

    @classmethod
    def of(cls, doc_ids: torch.Tensor) -> "PackedRows":
        """The layout of doc_ids [N, T] (reads them on the host, once)."""
        if doc_ids.dim() != 2 or doc_ids.shape[1] == 0:
            raise ValueError(f"doc_ids must be [N, T] with T > 0, got {list(doc_ids.shape)}")
        lengths = [_doc_lengths(row) for row in doc_ids.cpu()]
        counts = [_chunks(row) for row in lengths]
        # pad = 64 m tokens add between m (all appended) and 64 m (all single) chunks
        m = math.ceil((max(counts) - min(counts)) / (FLA_CHUNK - 1))
        pad, n_chunks = FLA_CHUNK * m, max(counts) + m
        segments = []
        for row, count in zip(lengths, counts):
            singles = _pad_split(row[-1], pad, n_chunks - count)
            segments.append(row[:-1] + [row[-1] + pad - singles] + [1] * singles)
        n_segments = max(len(s) for s in segments)
        starts, chunks = [], []
        for seg in segments:
            edges = [0]
            for n in seg:
                edges.append(edges[-1] + n)
            starts.append(edges + [edges[-1]] * (n_segments - len(seg)))
            chunks.append([(s, i) for s, n in enumerate(seg) for i in range(-(-n // FLA_CHUNK))])
            assert len(chunks[-1]) == n_chunks, (seg, n_chunks)
        device = doc_ids.device
        return cls(doc_ids, torch.tensor(starts, device=device), torch.tensor(chunks, device=device),
                   torch.tensor([len(row) - 1 for row in lengths], device=device), pad)

    @property
    def shape(self) -> torch.Size:
        return self.doc_ids.shape

    @property
    def device(self) -> torch.device:
        return self.doc_ids.device

    def __getitem__(self, index) -> "PackedRows":
        """The rows `index` (a slice, an int or an index tensor; gathered on the device)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return PackedRows(self.doc_ids[index], self.starts[index], self.chunks[index], self.last[index], self.pad)

    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flattened layout of these B rows, all on the device: cu_seqlens [B*S+1], chunk_indices
        [B*C, 2] (int64), the first and the last segment of every row [B]."""
        b, t = self.doc_ids.shape
        n_segments = self.starts.shape[1] - 1
        rows = torch.arange(b, device=self.device)
        span = t + self.pad
        cu = (self.starts[:, :-1] + rows[:, None] * span).reshape(-1)
        cu = torch.cat([cu, cu.new_full((1,), b * span)])
        chunks = self.chunks + torch.stack([rows * n_segments, torch.zeros_like(rows)], -1)[:, None, :]
        first = rows * n_segments
        return cu, chunks.reshape(-1, 2), first, first + self.last
