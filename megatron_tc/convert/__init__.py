"""HF <-> megatron_tc checkpoint conversion, resharding and student export.

Public API (imported lazily, so `import megatron_tc.convert` stays cheap)::

    convert_hf_to_megatron(hf, out, tp, pp, dtype=None, overwrite=False)   HF dir / .gguf -> checkpoint
    export_to_hf(ckpt, out, overwrite=False)                              checkpoint -> HF dir
    save_checkpoint(state, arch, out, tp, pp, ...)                        HybridLM state -> checkpoint
    load_checkpoint(dir) -> (arch, state)                                 unsharded HybridLM state
    load_shard(dir, tp_rank, pp_rank) -> Megatron-named tensors of one rank
    load_shard_hybrid(dir, tp_rank, pp_rank) -> one rank's part under HybridLM names
    load_rank(dir, tp, pp, tp_rank, pp_rank) -> one rank of another layout, reading only its slices
    load_slices(dir, pick, padded_vocab) -> HybridLM-named slices of the unsharded tensors, only those read
    read_info(dir) -> CheckpointInfo;  checkpoint_hash(dir) -> str;  reshard(src, dst, tp, pp)
    load_hybrid_lm(dir) -> HybridLM
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "convert_hf_to_megatron": "hf_to_megatron", "load_hybrid_lm": "hf_to_megatron",
    "export_to_hf": "export",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "load_shard": "checkpoint",
    "load_shard_hybrid": "checkpoint", "load_shards": "checkpoint", "read_info": "checkpoint",
    "checkpoint_hash": "checkpoint", "reshard": "checkpoint", "is_checkpoint": "checkpoint",
    "load_rank": "checkpoint", "load_slices": "checkpoint", "lazy_checkpoint": "checkpoint",
    "CheckpointInfo": "checkpoint",
    "ConversionError": "errors", "CheckpointError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_tc.convert' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatron_tc.convert.{_EXPORTS[name]}"), name)
