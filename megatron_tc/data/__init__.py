"""Data: documents from text sources, the calibration/train/eval manifest, tokenization, packing
with document boundaries, and deterministic DP-sharded resumable loading.

Importing this package is cheap; `datasets` and `transformers` load only when used.
"""
from .bos import bos_record, resolve_bos_id, tokenizer_adds_bos
from .corpus import default_cache_dir, fetch_shakespeare, shakespeare_cached, shakespeare_documents
from .documents import DataError, Document
from .loader import DistributedBatchLoader
from .manifest import MANIFEST_NAME, SPLITS, Manifest, SplitConfig, assign_splits, load_or_create_manifest
from .packing import (
    IGNORE_INDEX,
    PackedSequences,
    TokenStream,
    attention_mask_from_doc_ids,
    document_starts,
    position_ids_from_doc_ids,
)
from .pipeline import DataConfig, PreparedData, dedupe_documents, prepare_data
from .sources import SourceConfig, load_documents
from .tokenize import cached_token_stream, tokenize_documents
from .tokenizer import check_same_tokenizer, check_vocab_fits, load_tokenizer, resolve_eos_id, tokenizer_fingerprint

__all__ = [
    "DataConfig", "DataError", "DistributedBatchLoader", "Document", "IGNORE_INDEX", "MANIFEST_NAME", "Manifest",
    "PackedSequences", "PreparedData", "SPLITS", "SourceConfig", "SplitConfig", "TokenStream", "assign_splits",
    "attention_mask_from_doc_ids", "bos_record", "cached_token_stream", "check_same_tokenizer", "check_vocab_fits", "dedupe_documents",
    "default_cache_dir", "document_starts", "fetch_shakespeare", "load_documents", "load_or_create_manifest",
    "load_tokenizer", "position_ids_from_doc_ids", "prepare_data", "resolve_bos_id", "resolve_eos_id", "shakespeare_cached",
    "shakespeare_documents", "tokenize_documents", "tokenizer_adds_bos", "tokenizer_fingerprint",
]
