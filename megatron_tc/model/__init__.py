"""Single-device model: `HybridLM` (softmax attention + Gated DeltaNet layers) and its parts."""
from .attention import Attention
from .cache import AttentionCache, GDNCache, HybridCache
from .config import FAMILIES, ArchConfig, ArchConfigError, pad_vocab
from .gdn import GatedDeltaNet
from .generate import generate, sample_next
from .mlp import GatedMLP
from .norm import RMSNorm
from .ops import gated_delta_rule, iter_attention_probs
from .transformer import DecoderLayer, HybridLM

__all__ = [
    "FAMILIES",
    "ArchConfig",
    "ArchConfigError",
    "Attention",
    "AttentionCache",
    "DecoderLayer",
    "GDNCache",
    "GatedDeltaNet",
    "GatedMLP",
    "HybridCache",
    "HybridLM",
    "RMSNorm",
    "gated_delta_rule",
    "generate",
    "sample_next",
    "iter_attention_probs",
    "pad_vocab",
]
