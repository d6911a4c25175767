"""RMSNorm in the Llama form (`w * x_hat`) and the Gemma form (`(1 + w) * x_hat`)."""
from __future__ import annotations

import torch
from torch import nn

from .fused import fused, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32.

    unit_offset=False (Llama, Qwen, Mistral): weight starts at 1, output `w * x_hat.to(dtype)`.
    unit_offset=True (Gemma): weight starts at 0, output `(x_hat * (1 + w)).to(dtype)`.
    Both follow their Hugging Face counterparts' rounding order, so bf16 matches too.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel per direction while training on CUDA, this exact formula elsewhere
        return fused("rms_norm", rms_norm, x)(x, self.weight, self.eps, self.unit_offset)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
