"""Configuration of a megatron_tc hybrid student (model_type "megatron_tc_hybrid").

Self-contained: imports only transformers, so an exported student directory carries this file
verbatim and loads with `trust_remote_code=True` where megatron_tc is not installed.
`arch` holds the whole architecture (megatron_tc's `ArchConfig.to_dict()`); the usual HF names
(vocab_size, hidden_size, ...) are derived from it for tools that read them.
"""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "megatron_tc_hybrid"
ARCH_DEFAULTS: dict[str, Any] = {
    "layer_pattern": "", "padded_vocab_size": 0, "max_position_embeddings": 2048, "norm_eps": 1e-6,
    "norm_unit_offset": False, "mlp_activation": "silu", "tie_embeddings": False, "embed_scale": 1.0,
    "attention_bias": False, "qk_norm": False, "sandwich_norm": False, "query_scale": None,
    "rope_theta": 10000.0, "rope_scaling": None, "rope_local_theta": None, "sliding_window": None,
    "attn_layer_types": [], "gdn_conv_size": 0, "gdn_expand_kv": True, "gdn_b_bias": True,
    "gdn_chunk_size": 64, "final_logit_softcap": None,
}
REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")


class MegatronTCConfig(PretrainedConfig):
    """HF config of a hybrid student; `arch` is the architecture dict (see module docstring)."""

    model_type = MODEL_TYPE

    def __init__(self, arch: dict | None = None, use_cache: bool = True, **kwargs: Any) -> None:
        self.arch = dict(arch) if arch else None
        self.use_cache = use_cache
        if self.arch:  # HF tools read these names; the model reads only `arch`
            a = self.arch
            missing = [k for k in REQUIRED if k not in a]
            if missing:
                raise ValueError(f"config.json: `arch` lacks {missing}; re-export the student with megatron_tc")
            for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                         "head_dim", "intermediate_size", "max_position_embeddings", "layer_pattern"):
                kwargs.pop(name, None)
            self.vocab_size, self.hidden_size = a["vocab_size"], a["hidden_size"]
            self.intermediate_size, self.num_hidden_layers = a["intermediate_size"], a["num_layers"]
            self.num_attention_heads, self.num_key_value_heads = a["num_heads"], a["num_kv_heads"]
            self.head_dim = a["head_dim"]
            self.max_position_embeddings = a.get("max_position_embeddings", 2048)
            self.layer_pattern = a.get("layer_pattern") or "A" * a["num_layers"]
            kwargs["tie_word_embeddings"] = bool(a.get("tie_embeddings", False))
        super().__init__(**kwargs)

    def arch_value(self, name: str) -> Any:
        """One architecture field, with megatron_tc's default when the export predates it."""
        if not self.arch:
            raise ValueError("MegatronTCConfig has no `arch`: build it with MegatronTCConfig.from_arch(arch)")
        return self.arch.get(name, ARCH_DEFAULTS.get(name))

    @classmethod
    def from_arch(cls, arch: Any, **kwargs: Any) -> "MegatronTCConfig":
        """From megatron_tc's `ArchConfig` (anything with `to_dict()`) or a plain dict."""
        return cls(arch=arch if isinstance(arch, dict) else arch.to_dict(), **kwargs)
