"""Learning-rate schedule: linear warmup, then cosine / linear decay to a floor, or constant.

We step it ourselves from the training step (not through DeepSpeed's scheduler), so the rate is a
pure function of the step: a resumed run and a run that skipped a non-finite step stay on the same
curve. Parameter groups may have different peak rates (e.g. gates faster than projections); each
group keeps its peak in ``group["peak_lr"]`` and every group follows the same shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class LRSchedule:
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"  # "cosine" | "linear" | "constant"
    min_ratio: float = 0.0  # final rate / peak rate

    def __post_init__(self) -> None:
        if self.kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule {self.kind!r}: use cosine, linear or constant")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"total_steps={self.total_steps} must be >= 1 and warmup_steps={self.warmup_steps} >= 0")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_lr / lr = {self.min_ratio} must lie in [0, 1]")

    def factor(self, step: int) -> float:
        """Multiplier of the peak rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def remember_peak_lr(param_groups: Iterable[dict[str, Any]]) -> None:
    """Record each group's configured rate as its peak (once, before the first step)."""
    for group in param_groups:
        group.setdefault("peak_lr", group["lr"])


def apply_lr(param_groups: Iterable[dict[str, Any]], schedule: LRSchedule, step: int) -> float:
    """Set every group's rate for `step`; return the first group's (for logging)."""
    factor = schedule.factor(step)
    rates = []
    for group in param_groups:
        group["lr"] = group["peak_lr"] * factor
        rates.append(group["lr"])
    return rates[0] if rates else 0.0
