"""Fault injection for the reliability tests, driven by one environment variable.

``MEGATRON_TC_FAULTS`` holds comma-separated entries; unset (the normal case) nothing happens:

    nan_loss@S            the training loss of step S becomes NaN (on every rank)
    nan_grad@S            the gradients of step S become NaN (the loss stays finite)
    kill@checkpoint:S     rank 0 SIGKILLs itself while writing the step-S checkpoint (before rename)
    kill@step:S           rank 0 SIGKILLs itself right after step S

Tests start real subprocesses with this variable to check skip/abort policies, resume after a kill
and half-written checkpoints.
"""
from __future__ import annotations

import os
import signal

ENV = "MEGATRON_TC_FAULTS"


def _entries() -> set[str]:
    raw = os.environ.get(ENV, "")
    return {e.strip() for e in raw.split(",") if e.strip()}


def active(kind: str, step: int) -> bool:
    """True when the fault `kind@step` (e.g. 'nan_loss', 3) is requested."""
    return f"{kind}@{step}" in _entries()


def maybe_kill(point: str, step: int) -> None:
    """Die without cleanup at `point` of `step` when ``kill@point:step`` is requested (rank 0)."""
    if f"kill@{point}:{step}" in _entries() and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
