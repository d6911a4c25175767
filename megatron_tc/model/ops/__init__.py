"""Kernels of the model: gated delta rule backends, attention masks and chunked probabilities."""
from .attention_probs import iter_attention_probs
from .gated_delta_rule import BACKENDS, fla_available, gated_delta_rule
from .masks import attention_mask, positions_from_doc_ids

__all__ = [
    "BACKENDS",
    "attention_mask",
    "fla_available",
    "gated_delta_rule",
    "iter_attention_probs",
    "positions_from_doc_ids",
]
