"""Names the config accepts for stages, initialization strategies and retained-layer policies.

The strategy and policy registries live in `megatron_tc.calibrate` and import torch; the config
must be checkable without them (before any process group exists), so the accepted names are
kept here. A new strategy or policy either adds its name to the tuple below or calls
`register_init_strategy` / `register_policy` when its registry entry is defined.
"""
from __future__ import annotations

# Pipeline stages, in the order they run (docs/concepts.md).
# `pretrain` (optional, first) trains a teacher from scratch with the next-token objective and
# writes it where model.teacher points, so the stages after it convert that model.
STAGES: tuple[str, ...] = ("pretrain", "convert", "select", "stats", "init", "stage1", "stage2", "eval", "export")

# Initialization strategies (docs/method.md section 4). Add the project's own strategy here (or
# register it at import time).
INIT_STRATEGIES: tuple[str, ...] = ("naive", "zero_gate", "taylor", "taylor_calibrate", "taylor_fit")

# Retained-layer policies (docs/method.md section 6): every k-th layer, attention-removal ranking,
# greedy addition, and the cheap one computed from the statistics pass.
POLICIES: tuple[str, ...] = ("uniform", "ar", "ga", "stats")

_extra_init: list[str] = []
_extra_policies: list[str] = []


def register_init_strategy(name: str) -> None:
    """Make `name` an accepted value of `calibrate.init` (idempotent)."""
    if name not in INIT_STRATEGIES and name not in _extra_init:
        _extra_init.append(name)


def register_policy(name: str) -> None:
    """Make `name` an accepted value of `model.policy` (idempotent)."""
    if name not in POLICIES and name not in _extra_policies:
        _extra_policies.append(name)


def init_strategy_names() -> tuple[str, ...]:
    return INIT_STRATEGIES + tuple(_extra_init)


def policy_names() -> tuple[str, ...]:
    return POLICIES + tuple(_extra_policies)
