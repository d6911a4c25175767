"""Hugging Face classes for exported hybrid students (model_type "megatron_tc_hybrid").

`MegatronTCConfig` carries the `ArchConfig` (under `arch`) plus the usual HF fields derived from
it; `MegatronTCForCausalLM` wraps `HybridLM` (state-dict names are HybridLM's under `model.`), so
`AutoModelForCausalLM.from_pretrained(dir)` works after `import megatron_tc` (which registers both
classes) or with `trust_remote_code=True` (the export writes `auto_map` and two small modules that
import this one; megatron_tc must be installed). `generate()` works through GenerationMixin and
uses HybridLM's own cache (KV for attention layers, recurrent state for GDN layers).

This module imports transformers but not deepspeed or fla; HybridLM is imported when a model is
built.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

MODEL_TYPE = "megatron_tc_hybrid"


class MegatronTCConfig(PreTrainedConfig):
    """HF config of a megatron_tc hybrid; `arch` is `ArchConfig.to_dict()`."""

    model_type = MODEL_TYPE
    arch: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    layer_pattern: str | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        if self.arch:  # HF tools read these names; the model reads only `arch`
            a = self.arch
            self.vocab_size, self.hidden_size = a["vocab_size"], a["hidden_size"]
            self.intermediate_size, self.num_hidden_layers = a["intermediate_size"], a["num_layers"]
            self.num_attention_heads, self.num_key_value_heads = a["num_heads"], a["num_kv_heads"]
            self.head_dim, self.max_position_embeddings = a["head_dim"], a["max_position_embeddings"]
            self.layer_pattern = a["layer_pattern"]
            self.tie_word_embeddings = a["tie_embeddings"]
        super().__post_init__(**kwargs)

    def to_arch(self):
        from megatron_tc.model.config import ArchConfig

        if not self.arch:
            raise ValueError("MegatronTCConfig has no `arch`: build it with MegatronTCConfig.from_arch(arch)")
        return ArchConfig.from_dict(dict(self.arch))

    @classmethod
    def from_arch(cls, arch, **kwargs: Any) -> "MegatronTCConfig":
        return cls(arch=arch.to_dict(), **kwargs)


class MegatronTCPreTrainedModel(PreTrainedModel):
    config_class = MegatronTCConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # HybridLM brings its own cache (KV + recurrent state); see forward

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights come from the checkpoint; only RoPE tables (non-persistent buffers, left empty
        by transformers' meta-device loading) are recomputed here."""
        from megatron_tc.model.rope import RotaryEmbedding

        if isinstance(module, RotaryEmbedding) and hasattr(self, "model"):
            reset_rope_buffers(self.model)


def reset_rope_buffers(model: torch.nn.Module) -> None:
    """Recompute every attention layer's RoPE table (`RotaryEmbedding.reset_buffers`, fp32) on
    the device of that layer's weights."""
    from megatron_tc.model.attention import Attention

    for layer in model.layers:
        if isinstance(layer.mixer, Attention):
            layer.mixer.rope.reset_buffers(layer.mixer.q_proj.weight.device)


class MegatronTCForCausalLM(MegatronTCPreTrainedModel, GenerationMixin):
    """`HybridLM` as a transformers causal LM. forward(input_ids [B, T]) -> logits [B, T, vocab]."""

    def __init__(self, config: MegatronTCConfig) -> None:
        super().__init__(config)
        from megatron_tc.model import HybridLM

        self.model = HybridLM(config.to_arch())
        self.post_init()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.model.lm_head  # None when tied: HybridLM reuses the embedding

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids [B, T]; attention_mask must be all ones (no padding: HybridLM's GDN state
        cannot skip pad tokens); cache: a `HybridCache` from a previous call, or None."""
        from megatron_tc.model import HybridCache

        if inputs_embeds is not None:
            raise ValueError("MegatronTCForCausalLM takes input_ids, not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "padded batches are not supported (the GDN recurrence would read pad tokens); "
                "generate or score one sequence per row without padding"
            )
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, HybridCache):
            raise TypeError(f"cache must be a megatron_tc HybridCache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = HybridCache(self.model.arch)
        logits = self.model(input_ids, position_ids=position_ids, cache=cache if use_cache else None)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)


def register() -> None:
    """Register the classes with AutoConfig / AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, MegatronTCConfig, exist_ok=True)
    AutoModelForCausalLM.register(MegatronTCConfig, MegatronTCForCausalLM, exist_ok=True)


register()  # importing this module (e.g. through trust_remote_code) is enough to use the Auto classes
