"""Fault injection for the reliability tests, driven by one environment variable.

``MEGATRON_TC_FAULTS`` holds comma-separated entries; unset (the normal case) nothing happens:

    nan_loss@S            the training loss of step S becomes NaN (on every rank)
    nan_grad@S            the gradients of step S become NaN (the loss stays finite)
    kill@checkpoint:S     rank 0 SIGKILLs itself while writing the step-S checkpoint (before rename)
    kill@step:S           rank 0 SIGKILLs itself right after step S
    term@step:S           rank 0 sends itself SIGTERM right after step S (the other ranks learn of it
                          through megatron_tc.distill.signals' all-reduce at the next step)
    pace@step:SECONDS     every rank sleeps SECONDS after each training step, in the first run of a
                          Slurm job only (SLURM_RESTART_COUNT unset or 0): a signal Slurm times lands
                          mid-stage, and the requeued run goes at full speed

Tests start real subprocesses with this variable to check skip/abort policies, resume after a kill
and half-written checkpoints.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "MEGATRON_TC_FAULTS"


def _entries() -> set[str]:
    raw = os.environ.get(ENV, "")
    return {e.strip() for e in raw.split(",") if e.strip()}


def active(kind: str, step: int) -> bool:
    """True when the fault `kind@step` (e.g. 'nan_loss', 3) is requested."""
    return f"{kind}@{step}" in _entries()


def maybe_kill(point: str, step: int) -> None:
    """On rank 0 at `point` of `step`: die without cleanup for ``kill@point:step``, or send itself
    SIGTERM for ``term@point:step``. Every rank, after a step: sleep for ``pace@step:SECONDS``."""
    if point == "step" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        for entry in _entries():
            if entry.startswith("pace@step:"):
                time.sleep(float(entry.split(":", 1)[1]))
    if os.environ.get("RANK", "0") != "0":
        return
    for kind, signum in (("kill", signal.SIGKILL), ("term", signal.SIGTERM)):
        if f"{kind}@{point}:{step}" in _entries():
            os.kill(os.getpid(), signum)
