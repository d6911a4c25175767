"""PackedRows (model/ops/gated_delta_rule/segments.py): the precomputed variable-length layout of
packed rows equals what raw doc_ids give.

fla's kernels need CUDA, so its calling convention is played here by a float64 reference: the
step-by-step recurrence run segment by segment over `cu_seqlens` (each segment from its own
initial state), which also checks the chunk indices against ones enumerated by hand from
`cu_seqlens`. Through it, the flattened, padded layout of PackedRows (any rows drawn by an index
tensor) must give the outputs and final states of the recurrence with doc_ids, and a GDN mixer
fed PackedRows the outputs and gradients of the mixer fed raw doc_ids. The GPU side (fla's
kernels, a CUDA graph) is tests/gpu/test_align_graph_cuda.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import gdn as gdn_module
from megatron_tc.model.config import ArchConfig
from megatron_tc.model.gdn import GatedDeltaNet
from megatron_tc.model.ops.gated_delta_rule import PackedRows, gated_delta_rule, recurrent_gated_delta_rule
from megatron_tc.model.ops.gated_delta_rule.fla_backend import varlen_call
from megatron_tc.model.ops.gated_delta_rule.segments import FLA_CHUNK


def doc_rows(lengths: list[list[int]]) -> torch.Tensor:
    """doc_ids [N, T] from each row's document lengths (ids counted from 0 in every row)."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])


ROWS = {  # T = 200: several documents, one document, one-token documents, lengths at chunk edges
    "mixed": [[100, 28, 72], [200], [1, 1, 198], [64, 64, 64, 8], [63, 1, 136], [3] * 40 + [80]],
    "equal chunk counts": [[200], [200], [150, 50]],
}


def chunks_by_hand(cu: list[int]) -> list[list[int]]:
    return [[s, i] for s in range(len(cu) - 1) for i in range(-(-(cu[s + 1] - cu[s]) // FLA_CHUNK))]


def reference_kernel(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                     use_qk_l2norm_in_kernel, chunk_indices=None):
    """fla's varlen convention over [1, L, ...] inputs, by the float64 recurrence per segment."""
    cu = cu_seqlens.tolist()
    assert q.shape[0] == 1 and cu[0] == 0 and cu[-1] == q.shape[1]
    if chunk_indices is not None:
        assert chunk_indices.tolist() == chunks_by_hand(cu)
    h, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    outs, finals = [], []
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        h0 = None if initial_state is None else initial_state[s:s + 1]
        if a == b:  # an empty segment keeps its initial state
            finals.append(torch.zeros(1, h, dk, dv, dtype=q.dtype) if h0 is None else h0)
            continue
        o, final = recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0,
                                              True, None, use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


def inputs(n: int, t: int, h: int = 2, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, t, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(n, t, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(n, t, h, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, torch.randn(n, h, d, d, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("name", list(ROWS))
def test_every_row_has_the_same_segment_and_chunk_counts(name):
    doc_ids = doc_rows(ROWS[name])
    rows = PackedRows.of(doc_ids)
    n, t = doc_ids.shape
    assert rows.pad % FLA_CHUNK == 0 and rows.shape == doc_ids.shape
    if name == "equal chunk counts":
        assert rows.pad == 0  # nothing to even out
    for r in range(n):
        starts = rows.starts[r].tolist()
        assert starts[0] == 0 and starts[-1] == t + rows.pad and starts == sorted(starts)
        assert rows.chunks[r].tolist() == chunks_by_hand(starts)
        # the row's documents keep their starts; its last one is segment `last`
        doc_starts = [0] + [i for i in range(1, t) if doc_ids[r, i] != doc_ids[r, i - 1]]
        assert starts[:len(doc_starts)] == doc_starts and int(rows.last[r]) == len(doc_starts) - 1


@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("pick", ["all", "drawn", "slice", "one"])
def test_packed_layout_equals_the_recurrence_with_doc_ids(name, pick):
    doc_ids = doc_rows(ROWS[name])
    n, t = doc_ids.shape
    index = {"all": slice(None), "drawn": torch.tensor([2, 0, 2, n - 1]), "slice": slice(1, 3), "one": n - 1}[pick]
    if isinstance(index, int):
        index = slice(index, index + 1)
    rows = PackedRows.of(doc_ids)[index]
    q, k, v, g, beta, h0 = (x[index] for x in inputs(n, t))
    kwargs = dict(scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_s = recurrent_gated_delta_rule(q, k, v, g, beta, 0.3, h0, True, doc_ids[index], True)
    got_o, got_s = varlen_call(reference_kernel, (q, k, v, g, beta), h0, rows, chunked=True, **kwargs)
    torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-12, atol=1e-12)
    # the raw doc_ids path of the same call (segments derived on every call) agrees too
    raw_o, raw_s = varlen_call(reference_kernel, (q, k, v, g, beta), h0, doc_ids[index], chunked=True, **kwargs)
    torch.testing.assert_close(raw_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(raw_s, want_s, rtol=1e-12, atol=1e-12)


def test_torch_backends_take_packed_rows_as_their_doc_ids():
    doc_ids = doc_rows(ROWS["mixed"])
    q, k, v, g, beta, h0 = inputs(*doc_ids.shape)
    for backend in ("chunk", "recurrent"):
        want = gated_delta_rule(q, k, v, g, beta, None, h0, True, doc_ids, True, backend=backend)
        got = gated_delta_rule(q, k, v, g, beta, None, h0, True, PackedRows.of(doc_ids), True, backend=backend)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_bad_doc_ids_are_refused():
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        PackedRows.of(torch.zeros(5, dtype=torch.long))


def fla_by_reference(q, k, v, g, beta, scale, initial_state, output_final_state, doc_ids, use_qk_l2norm, **_):
    """The mixer's call of the delta rule, routed as on CUDA (varlen_call) into the reference."""
    if doc_ids is None:
        return recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, None,
                                          use_qk_l2norm)
    kwargs = dict(scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return varlen_call(reference_kernel, (q, k, v, g, beta), initial_state, doc_ids, chunked=True, **kwargs)


@pytest.mark.parametrize("name", list(ROWS))
def test_mixer_with_packed_rows_equals_the_mixer_with_doc_ids(name, monkeypatch):
    arch = ArchConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=8, intermediate_size=32, layer_pattern="G", gdn_conv_size=4)
    torch.manual_seed(0)
    mixer = GatedDeltaNet(arch, 0).double()
    doc_ids = doc_rows(ROWS[name])
    x = torch.randn(*doc_ids.shape, 16, dtype=torch.float64)
    draw = torch.tensor([1, 0, 2])

    def run(docs):
        mixer.zero_grad()
        out = mixer(x[draw], doc_ids=docs)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in mixer.parameters()]

    want, want_grads = run(doc_ids[draw])  # the CPU path: the PyTorch chunked kernel with doc_ids
    monkeypatch.setattr(gdn_module, "_delta_rule_outside_graph", fla_by_reference)
    got, got_grads = run(PackedRows.of(doc_ids)[draw])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)
