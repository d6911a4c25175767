"""Dispatch to flash-linear-attention's Triton kernels (CUDA only; imported lazily).

Packed documents are passed to fla as variable-length sequences: the batch is flattened to one
row and every row start or document start opens a segment in `cu_seqlens`. The caller's
`initial_state` [B, H, Dk, Dv] becomes the state of each row's first segment, and the returned
final state is the one of each row's last segment. `PackedRows` bring that layout precomputed
(segments.py): no host read, shapes independent of the documents, as a CUDA graph needs.
"""
from __future__ import annotations

import importlib.util

import torch

from .common import reset_mask
from .segments import PackedRows


def fla_available() -> bool:
    """True when fla and triton are importable and CUDA is present."""
    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("fla") is not None
        and importlib.util.find_spec("triton") is not None
    )


def _segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens [S+1] (int64), first segment per row [B], last segment per row [B]."""
    b, t = doc_ids.shape
    starts = reset_mask(doc_ids, b, t, doc_ids.device)
    starts[:, 0] = True
    flat = starts.reshape(-1)
    offsets = flat.nonzero().squeeze(-1)
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([b * t])])
    segment_of_token = flat.long().cumsum(0) - 1
    rows = torch.arange(b, device=doc_ids.device) * t
    return cu_seqlens, segment_of_token[rows], segment_of_token[rows + t - 1]


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    doc_ids: torch.Tensor | PackedRows | None,
    use_qk_l2norm: bool,
    mode: str = "chunk",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run fla's `chunk_gated_delta_rule` (mode "chunk") or `fused_recurrent_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    kernel = chunk_gated_delta_rule if mode == "chunk" else fused_recurrent_gated_delta_rule
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)
    if doc_ids is None:
        return kernel(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, **kwargs)
    return varlen_call(kernel, (q, k, v, g, beta), initial_state, doc_ids, chunked=mode == "chunk", **kwargs)


def varlen_call(kernel, inputs: tuple[torch.Tensor, ...], initial_state: torch.Tensor | None,
                doc_ids: torch.Tensor | PackedRows, chunked: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kernel` (fla's calling convention) over rows of packed documents, flattened to one row of
    segments. inputs q, k, v, g, beta [B, T, H, ...]; returns o [B, T, H, Dv], final state [B, ...]
    or None. With PackedRows each row is padded to its span and the chunk indices are passed in."""
    b, t = inputs[0].shape[:2]
    extra = {}
    if isinstance(doc_ids, PackedRows):
        cu_seqlens, chunk_indices, first, last = doc_ids.varlen()
        if chunked:
            extra["chunk_indices"] = chunk_indices
        span = t + doc_ids.pad
        if doc_ids.pad:  # zeros: they neither change the state nor read it
            inputs = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, doc_ids.pad)) for x in inputs]
    else:
        cu_seqlens, first, last = _segments(doc_ids)
        span = t
    h0 = None
    if initial_state is not None:
        h0 = initial_state.new_zeros(cu_seqlens.numel() - 1, *initial_state.shape[1:]).index_copy(0, first, initial_state)
    q, k, v, g, beta = (x.reshape(1, b * span, *x.shape[2:]) for x in inputs)
    o, final = kernel(q, k, v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu_seqlens, **extra, **kwargs)
    o = o.reshape(b, span, *o.shape[2:])[:, :t]
    return o, (final[last] if final is not None else None)
