"""Architecture description shared by the model, the converters and the parallel code.

`ArchConfig` is the single source of truth for the shapes of a hybrid model. It is
family-agnostic: the converters translate a Hugging Face config (Llama, Qwen2, Mistral, Qwen3,
Gemma3) into the feature flags below, and the model only reads the flags.

State-dict names of `HybridLM` (single device, unsharded; ``i`` is the layer index)::

    embed_tokens.weight                      [padded_vocab_size, hidden_size]
    layers.{i}.input_norm.weight             [hidden_size]
    layers.{i}.post_attn_norm.weight         [hidden_size]   (sandwich_norm only: Gemma3)
    layers.{i}.pre_mlp_norm.weight           [hidden_size]
    layers.{i}.post_mlp_norm.weight          [hidden_size]   (sandwich_norm only: Gemma3)
    layers.{i}.mlp.{gate,up}_proj.weight     [intermediate_size, hidden_size]
    layers.{i}.mlp.down_proj.weight          [hidden_size, intermediate_size]
    norm.weight                              [hidden_size]
    lm_head.weight                           [padded_vocab_size, hidden_size]  (absent if tied)

  softmax attention layer ('A' in the pattern)::

    layers.{i}.mixer.q_proj.{weight,bias}    [num_heads * head_dim, hidden_size]
    layers.{i}.mixer.k_proj.{weight,bias}    [num_kv_heads * head_dim, hidden_size]
    layers.{i}.mixer.v_proj.{weight,bias}    [num_kv_heads * head_dim, hidden_size]
    layers.{i}.mixer.o_proj.weight           [hidden_size, num_heads * head_dim]
    layers.{i}.mixer.{q,k}_norm.weight       [head_dim]      (qk_norm only)

  Gated DeltaNet layer ('G' in the pattern; names follow flash-linear-attention)::

    layers.{i}.mixer.q_proj.{weight,bias}    [num_heads * head_dim, hidden_size]
    layers.{i}.mixer.{k,v}_proj.{weight,bias}[gdn_kv_heads * head_dim, hidden_size]
    layers.{i}.mixer.a_proj.weight           [num_heads, hidden_size]
    layers.{i}.mixer.b_proj.{weight,bias}    [num_heads, hidden_size]  (bias if gdn_b_bias)
    layers.{i}.mixer.A_log                   [num_heads]
    layers.{i}.mixer.dt_bias                 [num_heads]
    layers.{i}.mixer.g_proj.weight           [num_heads * head_dim, hidden_size]
    layers.{i}.mixer.o_norm.weight           [head_dim]
    layers.{i}.mixer.o_proj.weight           [hidden_size, num_heads * head_dim]
    layers.{i}.mixer.{q,k,v}_conv1d.weight   [channels, 1, gdn_conv_size]  (gdn_conv_size > 0)

q/k/v biases exist exactly where ``attention_bias`` is set (both layer types), so a converted
GDN layer can copy them from the teacher.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3")
LAYER_KINDS = {"A": "softmax attention", "G": "Gated DeltaNet"}


class ArchConfigError(ValueError):
    """An architecture description that cannot describe a valid model."""


@dataclass
class ArchConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # One character per layer: 'A' softmax attention, 'G' Gated DeltaNet. Empty means all 'A'.
    # A '|' may mark pipeline-stage boundaries; it is not a layer.
    layer_pattern: str = ""
    # Rows of the embedding / LM head; >= vocab_size. Padding rows never produce logits.
    padded_vocab_size: int = 0
    max_position_embeddings: int = 2048

    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight)
    mlp_activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma GeGLU)
    tie_embeddings: bool = False
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)

    attention_bias: bool = False  # q/k/v biases (Qwen2); o_proj never has one
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
    sandwich_norm: bool = False  # Gemma3: post-attention and post-MLP norms as well
    query_scale: float | None = None  # softmax scale; None means head_dim ** -0.5

    rope_theta: float = 10000.0
    # None, or a dict like HF's: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} or {"rope_type": "linear", "factor"}
    rope_scaling: dict[str, Any] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma3)
    sliding_window: int | None = None
    # Per layer "full" or "sliding"; empty means every layer is "sliding" when sliding_window
    # is set (Mistral), else "full".
    attn_layer_types: list[str] = field(default_factory=list)

    # Gated DeltaNet options
    gdn_conv_size: int = 0  # 0: no short convolution (the paper's student, SiLU only)
    gdn_expand_kv: bool = True  # GDN k/v have num_heads heads (teacher KV heads repeated)
    gdn_b_bias: bool = True  # a b_proj bias, so a mean write strength can be set
    gdn_chunk_size: int = 64

    # Gemma3's final_logit_softcapping: logits = cap * tanh(logits / cap); None: off
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_pattern:
            self.layer_pattern = "A" * self.num_layers
        if not self.padded_vocab_size:
            self.padded_vocab_size = self.vocab_size
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> str:
        """The pattern without stage separators: one 'A' or 'G' per layer."""
        return self.layer_pattern.replace("|", "")

    @property
    def gdn_kv_heads(self) -> int:
        return self.num_heads if self.gdn_expand_kv else self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def layer_type(self, index: int) -> str:
        """'full' or 'sliding' for softmax attention at layer `index`."""
        if self.attn_layer_types:
            return self.attn_layer_types[index]
        return "sliding" if self.sliding_window else "full"

    def with_pattern(self, pattern: str) -> "ArchConfig":
        return dataclasses.replace(self, layer_pattern=pattern)

    # ---- checks and IO ---------------------------------------------------------------------
    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ArchConfigError(f"family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        kinds = self.layer_kinds
        if len(kinds) != self.num_layers:
            raise ArchConfigError(
                f"layer_pattern {self.layer_pattern!r} has {len(kinds)} layers but the model has "
                f"{self.num_layers}; give one of {'/'.join(LAYER_KINDS)} per layer"
            )
        bad = sorted(set(kinds) - set(LAYER_KINDS))
        if bad:
            raise ArchConfigError(
                f"layer_pattern {self.layer_pattern!r} contains {bad}; use 'A' (softmax attention), "
                "'G' (Gated DeltaNet) and optionally '|' between pipeline stages"
            )
        if self.num_heads % self.num_kv_heads:
            raise ArchConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ArchConfigError(f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}")
        if self.attn_layer_types and len(self.attn_layer_types) != self.num_layers:
            raise ArchConfigError(f"attn_layer_types has {len(self.attn_layer_types)} entries for {self.num_layers} layers")
        if any(t not in ("full", "sliding") for t in self.attn_layer_types):
            raise ArchConfigError(f"attn_layer_types entries must be 'full' or 'sliding': {self.attn_layer_types}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ArchConfigError(f"mlp_activation {self.mlp_activation!r}: use 'silu' or 'gelu_tanh'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArchConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ArchConfigError(f"unknown architecture keys {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def pad_vocab(vocab_size: int, tp: int = 1, multiple: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `multiple * tp`."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)
