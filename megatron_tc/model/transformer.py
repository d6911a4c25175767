"""Decoder layers and the single-device hybrid language model `HybridLM`."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import Attention
from .cache import HybridCache
from .config import ArchConfig
from .gdn import GatedDeltaNet
from .mlp import GatedMLP
from .norm import RMSNorm
from .ops.masks import positions_from_doc_ids
from .rope import shared_tables


class DecoderLayer(nn.Module):
    """Pre-norm block; with sandwich_norm (Gemma3) the mixer and MLP outputs are normed too::

        h   = x + post_attn_norm(mixer(input_norm(x)))
        out = h + post_mlp_norm(mlp(pre_mlp_norm(h)))
    """

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = arch.layer_kinds[layer_idx]
        norm = lambda: RMSNorm(arch.hidden_size, arch.norm_eps, arch.norm_unit_offset)  # noqa: E731
        self.input_norm = norm()
        self.mixer: Attention | GatedDeltaNet = (
            Attention(arch, layer_idx) if self.kind == "A" else GatedDeltaNet(arch, layer_idx)
        )
        self.post_attn_norm = norm() if arch.sandwich_norm else None
        self.pre_mlp_norm = norm()
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_activation)
        self.post_mlp_norm = norm() if arch.sandwich_norm else None

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; cache is the whole model's cache (or None)."""
        entry = cache.layer(self.layer_idx) if cache is not None else None
        h = self.mixer(self.input_norm(x), position_ids, doc_ids, entry)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.pre_mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


class HybridLM(nn.Module):
    """Decoder LM whose layers follow `arch.layer_pattern` ('A' attention, 'G' Gated DeltaNet).

    forward(input_ids [B, T]) -> logits [B, T, vocab_size] (padding rows of the vocab are cut).
    Parts for pipeline / stage-1 code: `embed(ids)`, `layers[i](x, position_ids, doc_ids)`,
    `norm`, `logits(h)` (LM head on normed hidden states), `resolve_positions(...)`.
    `set_activation_checkpointing(True)` recomputes every decoder layer in backward.
    """

    def __init__(self, arch: ArchConfig, init_std: float = 0.02) -> None:
        super().__init__()
        self.arch = arch
        self.init_std = init_std
        self.embed_tokens = nn.Embedding(arch.padded_vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.norm_eps, arch.norm_unit_offset)
        self.lm_head = None if arch.tie_embeddings else nn.Linear(arch.hidden_size, arch.padded_vocab_size, bias=False)
        self.activation_checkpointing = False
        self.reset_parameters()

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Keep only each decoder layer's input during a training forward and recompute the layer
        in backward (`torch.utils.checkpoint`, RNG state preserved), attention and GDN layers
        alike: activation memory falls from every layer's intermediates to one [B, T, hidden]
        tensor per layer, for about one more forward. The reentrant form: its recompute is a whole
        forward and backward of the layer, so ZeRO-3's per-module gather/release hooks pair up
        (the non-reentrant form stops the recompute early and leaves them unpaired). Applies only
        when gradients are enabled and no decoding cache is used; the results are unchanged."""
        self.activation_checkpointing = enabled

    # ---- initialization ------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for projections and embeddings, zero biases, norms at identity,
        fla's defaults for A_log / dt_bias, zero padding rows of the vocabulary."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=self.init_std)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, RMSNorm):
                    module.reset_parameters()
                elif isinstance(module, nn.Conv1d):
                    module.reset_parameters()
            for module in self.modules():
                if isinstance(module, GatedDeltaNet):
                    module.reset_gdn_parameters()
            self.embed_tokens.weight[self.arch.vocab_size :].zero_()
            if self.lm_head is not None:
                self.lm_head.weight[self.arch.vocab_size :].zero_()

    def set_gdn_backend(self, backend: str) -> None:
        """Kernel of every GDN layer: 'auto', 'chunk', 'recurrent', 'fla', ..."""
        for layer in self.layers:
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.set_backend(backend)

    # ---- pieces ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, hidden], times embed_scale cast to the weight dtype (as HF)."""
        x = self.embed_tokens(input_ids)
        if self.arch.embed_scale != 1.0:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype, device=x.device)
        return x

    @property
    def output_weight(self) -> torch.Tensor:
        """[padded_vocab, hidden]: lm_head.weight, or the embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [B, T, hidden] -> logits [B, T, vocab_size] (padding rows never computed)."""
        logits = hidden @ self.output_weight[: self.arch.vocab_size].t()
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def resolve_positions(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
    ) -> torch.Tensor:
        """position_ids [B, T]: given, restarting per document, or following the cache."""
        b, t = input_ids.shape
        if position_ids is not None:
            if position_ids.shape != (b, t):
                raise ValueError(f"position_ids must be [B, T] = {[b, t]}, got {list(position_ids.shape)}")
            return position_ids
        if doc_ids is not None:
            if doc_ids.shape != (b, t):
                raise ValueError(f"doc_ids must be [B, T] = {[b, t]}, got {list(doc_ids.shape)}")
            return positions_from_doc_ids(doc_ids)
        offset = cache.seen_tokens if cache is not None else 0
        return torch.arange(offset, offset + t, device=input_ids.device).expand(b, t)

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab_size] (or final normed hidden [B, T, hidden]).

        doc_ids [B, T]: packed documents (attention masked across them, GDN state reset, positions
        restart unless position_ids is given). cache: a `HybridCache` that is read and advanced.
        """
        if cache is not None and doc_ids is not None:
            raise ValueError("doc_ids (packed documents) cannot be combined with a decoding cache")
        position_ids = self.resolve_positions(input_ids, position_ids, doc_ids, cache)
        x = self.embed(input_ids)
        recompute = getattr(self, "activation_checkpointing", False) and cache is None and torch.is_grad_enabled()
        if recompute and not x.requires_grad:
            x.requires_grad_(True)  # frozen embedding: the reentrant recompute needs an input with a gradient
        with shared_tables():  # RoPE's cos / sin made once for all layers
            for layer in self.layers:
                if recompute:
                    x = checkpoint(layer, x, position_ids, doc_ids, None, use_reentrant=True)
                else:
                    x = layer(x, position_ids, doc_ids, cache)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        x = self.norm(x)
        return x if return_hidden else self.logits(x)
