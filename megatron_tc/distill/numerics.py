"""What to do when a loss or a gradient is NaN or inf: skip the step and count it, or abort.

Every rank must take the same branch (ZeRO-3 gathers parameters collectively), so finiteness is
agreed on with an all-reduce before anyone runs backward. A non-finite *gradient* is caught by
DeepSpeed itself: ZeRO's step computes the global gradient norm and skips the update when it is not
finite (`engine.was_step_applied()` is then False); the guard counts that the same way.
"""
from __future__ import annotations

import logging

import torch

from megatron_tc.parallel.comm import all_ranks

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient under nan_policy 'abort' (or too many skipped steps)."""


def all_finite(value: torch.Tensor, group=None) -> bool:
    """True on every rank iff `value` is finite on every rank of `group` (default: the world)."""
    return all_ranks(bool(torch.isfinite(value.detach()).all()), group)


class NonFiniteGuard:
    """Applies nan_policy ('skip' or 'abort') and counts skipped steps (restored on resume)."""

    def __init__(self, policy: str, max_skipped: int, skipped: int = 0):
        if policy not in ("skip", "abort"):
            raise ValueError(f"nan_policy {policy!r}: use 'skip' or 'abort'")
        self.policy = policy
        self.max_skipped = max_skipped
        self.skipped = skipped

    def record(self, step: int, what: str) -> None:
        """Called when step `step` had a non-finite `what` ('loss' or 'gradient'): count or raise."""
        if self.policy == "abort":
            raise NonFiniteError(f"step {step}: non-finite {what}; distill.nan_policy=abort stops the run "
                                 "(set distill.nan_policy=skip to skip such steps, or lower the learning rate)")
        self.skipped += 1
        log.warning("step %d: non-finite %s, step skipped (%d skipped so far)", step, what, self.skipped)
        if self.skipped > self.max_skipped:
            raise NonFiniteError(f"{self.skipped} steps skipped for NaN/inf (distill.max_skipped="
                                 f"{self.max_skipped}); the run is diverging: lower the learning rate or "
                                 "check the data, then resume from the last checkpoint")
