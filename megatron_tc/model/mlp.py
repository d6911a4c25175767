"""Gated MLP: SwiGLU (Llama, Qwen, Mistral) or GELU-tanh GeGLU (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from .fused import fused, glu


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); x [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {activation!r}: use 'silu' or 'gelu_tanh'")
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(fused("glu", glu, gate)(gate, up, self.activation))
