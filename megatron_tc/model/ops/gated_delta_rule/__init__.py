"""The gated delta rule behind one function, with three interchangeable backends.

Layout follows flash-linear-attention: q, k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H] (log
decay, <= 0), beta [B, T, H] (write strength in (0, 1)), states [B, H, Dk, Dv]. Per head::

    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale * q_t)

Backends: "recurrent" (step-by-step reference), "chunk" (pure-PyTorch chunked WY/UT form, the
CPU training path), "fla" (Triton kernels on CUDA: chunked for training/prefill, fused recurrent
for short no-grad decoding steps), "auto" (fla on CUDA when installed, else chunk).
"""
from __future__ import annotations

import torch

from .chunk import chunk_gated_delta_rule_torch
from .common import l2norm
from .fla_backend import fla_available, fla_gated_delta_rule
from .recurrent import recurrent_gated_delta_rule
from .segments import PackedRows

BACKENDS = ("auto", "chunk", "recurrent", "fla", "fla_chunk", "fla_recurrent")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | PackedRows | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a batch of sequences.

    Args:
        q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] log decay; beta: [B, T, H].
        scale: query scale, default Dk ** -0.5.
        initial_state: [B, H, Dk, Dv] state before position 0 (zeros if None).
        output_final_state: also return the state after the last position.
        doc_ids: [B, T] int document ids of packed sequences; the state is zeroed where the id
            changes (initial_state applies to each row's first document only); or `PackedRows` of
            them, whose layout for fla's kernels is precomputed (no host read in the call).
        use_qk_l2norm: L2-normalize q and k inside (as fla's `use_qk_l2norm_in_kernel`).
        chunk_size: chunk length of the PyTorch chunked backend.
        backend: one of BACKENDS.
    Returns:
        o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] (fp32, fp64 for fp64 input) or None.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; use one of {BACKENDS}")
    if backend == "auto":
        backend = "fla" if q.is_cuda and fla_available() else "chunk"
    if backend == "fla":
        decoding = not torch.is_grad_enabled() and q.shape[1] <= 64
        backend = "fla_recurrent" if decoding else "fla_chunk"
    if isinstance(doc_ids, PackedRows) and backend in ("chunk", "recurrent"):
        doc_ids = doc_ids.doc_ids
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, doc_ids, use_qk_l2norm)
    if backend == "chunk":
        return chunk_gated_delta_rule_torch(*args, chunk_size=chunk_size)
    if backend == "recurrent":
        return recurrent_gated_delta_rule(*args)
    if not q.is_cuda:
        raise ValueError(f"backend {backend!r} runs fla's Triton kernels and needs CUDA tensors; use 'chunk' on CPU")
    return fla_gated_delta_rule(*args, mode="chunk" if backend == "fla_chunk" else "recurrent")


__all__ = [
    "BACKENDS",
    "PackedRows",
    "chunk_gated_delta_rule_torch",
    "fla_available",
    "gated_delta_rule",
    "l2norm",
    "recurrent_gated_delta_rule",
]
