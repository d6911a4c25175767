"""Hugging Face teacher <-> `HybridLM`: architecture and unsharded state-dict names.

Supported `model_type`s: llama, qwen2, mistral, qwen3, gemma3_text (Gemma3ForCausalLM; a
multimodal Gemma3Config is accepted through its `text_config`). Tensors are moved, never
recomputed: the only change is zero padding of the vocabulary rows up to `padded_vocab_size`
(and slicing them off again), so a round trip is bitwise exact.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_tc.model.config import FAMILIES, ArchConfig, ArchConfigError

MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3",
               "gemma3_text": "gemma3", "gemma3": "gemma3"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


class HFMappingError(ValueError):
    """A Hugging Face config or state dict that cannot be mapped onto HybridLM."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def _rope(params: dict[str, Any] | None, legacy_theta: float | None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from a transformers-5 `rope_parameters` entry."""
    params = dict(params or {})
    theta = params.pop("rope_theta", legacy_theta if legacy_theta is not None else 10000.0)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFMappingError("partial_rotary_factor != 1 is not supported by HybridLM's RoPE")
    params.pop("partial_rotary_factor", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ("linear", "llama3"):
        raise HFMappingError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")
    params["rope_type"] = rope_type
    params.pop("type", None)
    return float(theta), params


def arch_from_hf_config(hf_config: Any, **overrides: Any) -> ArchConfig:
    """ArchConfig of an HF causal-LM config (object or dict); `overrides` set e.g. layer_pattern."""
    text = _get(hf_config, "text_config")
    if _get(hf_config, "model_type") == "gemma3" and text is not None:
        hf_config = text
    model_type = _get(hf_config, "model_type")
    if model_type not in MODEL_TYPES:
        raise HFMappingError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(sorted(MODEL_TYPES))} "
            f"(families {', '.join(FAMILIES)})"
        )
    family = MODEL_TYPES[model_type]
    heads = _get(hf_config, "num_attention_heads")
    hidden = _get(hf_config, "hidden_size")
    act = _get(hf_config, "hidden_activation") or _get(hf_config, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise HFMappingError(f"activation {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    bias = bool(_get(hf_config, "attention_bias", False))
    if family == "qwen2":
        bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    elif bias:
        raise HFMappingError(f"{family} with attention_bias=True also has an o_proj bias, which HybridLM lacks")
    if _get(hf_config, "mlp_bias", False):
        raise HFMappingError("mlp_bias=True is not supported (HybridLM's MLP has no biases)")
    fields: dict[str, Any] = dict(
        family=family, vocab_size=_get(hf_config, "vocab_size"), hidden_size=hidden,
        num_layers=_get(hf_config, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(hf_config, "num_key_value_heads") or heads,
        head_dim=_get(hf_config, "head_dim") or hidden // heads,
        intermediate_size=_get(hf_config, "intermediate_size"),
        max_position_embeddings=_get(hf_config, "max_position_embeddings", 2048),
        norm_eps=_get(hf_config, "rms_norm_eps", 1e-6), mlp_activation=_ACTIVATIONS[act],
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)), attention_bias=bias,
        qk_norm=family in ("qwen3", "gemma3"),
    )
    fields.update(_attention_layout(hf_config, family))
    if family == "gemma3":
        fields.update(
            norm_unit_offset=True, sandwich_norm=True, embed_scale=hidden**0.5,
            query_scale=_get(hf_config, "query_pre_attn_scalar") ** -0.5,
            final_logit_softcap=_get(hf_config, "final_logit_softcapping"),
        )
    fields.update(overrides)
    try:
        return ArchConfig(**fields)
    except ArchConfigError as err:
        raise HFMappingError(f"cannot build an ArchConfig from the {model_type} config: {err}") from err


def _attention_layout(hf_config: Any, family: str) -> dict[str, Any]:
    """RoPE, sliding window and per-layer attention types."""
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling")
    legacy_theta = _get(hf_config, "rope_theta")
    window = _get(hf_config, "sliding_window")
    layer_types = _get(hf_config, "layer_types")
    out: dict[str, Any] = {}
    if family == "gemma3":
        theta, scaling = _rope((params or {}).get("full_attention"), legacy_theta)
        local_theta, _ = _rope((params or {}).get("sliding_attention"), _get(hf_config, "rope_local_base_freq"))
        out.update(rope_local_theta=local_theta)
    else:
        theta, scaling = _rope(params, legacy_theta)
    out.update(rope_theta=theta, rope_scaling=scaling)
    if family == "mistral":
        return {**out, "sliding_window": window}
    if layer_types:
        types = [_LAYER_TYPES[t] for t in layer_types]
        if "sliding" in types:
            return {**out, "sliding_window": window, "attn_layer_types": types}
    return out


# ---- state dicts -----------------------------------------------------------------------------
def _name_pairs(arch: ArchConfig) -> list[tuple[str, str]]:
    """(HF name, HybridLM name) of every tensor except embeddings and head."""
    for i, kind in enumerate(arch.layer_kinds):
        if kind != "A":
            raise HFMappingError(
                f"layer {i} is a Gated DeltaNet layer ('{kind}' in {arch.layer_pattern!r}); HF teachers only have "
                "attention layers: map the teacher with an all-'A' pattern, then initialize GDN layers"
            )
    pairs = [("model.norm.weight", "norm.weight")]
    gemma = arch.family == "gemma3"
    for i in range(arch.num_layers):
        hf, tc = f"model.layers.{i}.", f"layers.{i}."
        pairs.append((hf + "input_layernorm.weight", tc + "input_norm.weight"))
        if gemma:
            pairs += [(hf + "post_attention_layernorm.weight", tc + "post_attn_norm.weight"),
                      (hf + "pre_feedforward_layernorm.weight", tc + "pre_mlp_norm.weight"),
                      (hf + "post_feedforward_layernorm.weight", tc + "post_mlp_norm.weight")]
        else:
            pairs.append((hf + "post_attention_layernorm.weight", tc + "pre_mlp_norm.weight"))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs.append((f"{hf}self_attn.{p}.weight", f"{tc}mixer.{p}.weight"))
            if arch.attention_bias and p != "o_proj":
                pairs.append((f"{hf}self_attn.{p}.bias", f"{tc}mixer.{p}.bias"))
        if arch.qk_norm:
            pairs += [(f"{hf}self_attn.{n}.weight", f"{tc}mixer.{n}.weight") for n in ("q_norm", "k_norm")]
        pairs += [(f"{hf}mlp.{p}.weight", f"{tc}mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
    return pairs


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _check_keys(have: set[str], expected: set[str], optional: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - have), sorted(have - expected - optional)
    if missing or unexpected:
        raise HFMappingError(
            f"{what} does not match the architecture: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


def hf_to_tc_names(names: set[str], arch: ArchConfig) -> dict[str, str]:
    """{HybridLM name: HF name} for an HF `*ForCausalLM` state dict holding `names` (a tied
    model's `lm_head.weight`, if present, is left out); missing or unexpected names raise."""
    pairs = _name_pairs(arch)
    head = set() if arch.tie_embeddings else {"lm_head.weight"}
    tied_head = {"lm_head.weight"} if arch.tie_embeddings else set()
    _check_keys(set(names), {h for h, _ in pairs} | {"model.embed_tokens.weight"} | head, tied_head, "HF state dict")
    out = {tc: hf for hf, tc in pairs}
    out["embed_tokens.weight"] = "model.embed_tokens.weight"
    if not arch.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    return out


def hf_to_tc_state_dict(sd: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """HF `*ForCausalLM` state dict -> HybridLM state dict (vocab rows zero-padded)."""
    names = hf_to_tc_names(set(sd), arch)
    embed = sd["model.embed_tokens.weight"]
    if embed.shape[0] != arch.vocab_size:
        raise HFMappingError(f"embed_tokens has {embed.shape[0]} rows but arch.vocab_size is {arch.vocab_size}")
    out = {tc: sd[hf] for tc, hf in names.items()}
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = _pad_rows(out[name], arch.padded_vocab_size)
    return out


def tc_to_hf_state_dict(sd: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """HybridLM state dict -> HF `*ForCausalLM` state dict (padding rows dropped).

    With tied embeddings `lm_head.weight` is the same tensor as `model.embed_tokens.weight`, as in
    `model.state_dict()` of HF; drop it before saving with safetensors (shared storage).
    """
    pairs = _name_pairs(arch)
    head = set() if arch.tie_embeddings else {"lm_head.weight"}
    _check_keys(set(sd), {tc for _, tc in pairs} | {"embed_tokens.weight"} | head, set(), "HybridLM state dict")
    out = {hf: sd[tc] for hf, tc in pairs}
    out["model.embed_tokens.weight"] = sd["embed_tokens.weight"][: arch.vocab_size]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if arch.tie_embeddings else sd["lm_head.weight"][: arch.vocab_size]
    return out
