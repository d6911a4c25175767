"""Initialization strategies of converted layers (docs/method.md section 4), as a registry.

A strategy maps (teacher layer weights, default GDN weights, statistics) to the state dict of a
Gated DeltaNet mixer. Nothing here runs a model: the readout sums a strategy needs were
accumulated by the statistics pass (`stats.collect_readout_stats`) using `closed_form` and
`gate_candidates`, so `init_layer` is a pure function of its inputs. The shared parts are in
`strategy_base.py`, the authors' closed form in `strategy_paper.py`, ours in `strategy_fit.py`;
`register` adds one.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .default_init import default_gdn_state
from .strategy_base import AlignSettings, LayerContext, State, Strategy, StrategyError, ZeroGate, copy_teacher
from .strategy_fit import TaylorFit
from .strategy_paper import Taylor

__all__ = ["AlignSettings", "LayerContext", "REGISTRY", "State", "Strategy", "StrategyError", "Taylor", "TaylorFit",
           "ZeroGate", "copy_teacher", "default_gdn_state", "get_strategy", "register", "PAPER_ALIGN",
           "PAPER_GA_ALIGN", "PAPER_GA_TOKENS", "TAYLOR_FIT_ALIGN"]

REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register(name: str, factory: Callable[[], Strategy]) -> None:
    """Add an init strategy; `calibrate.init` in a config accepts its name from then on."""
    from megatron_tc.config import register_init_strategy

    if name in REGISTRY:
        raise StrategyError(f"strategy {name!r} is registered twice")
    REGISTRY[name] = factory
    register_init_strategy(name)


def get_strategy(name: str) -> Strategy:
    if name not in REGISTRY:
        raise StrategyError(f"unknown init strategy {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]()


# the authors' alignment (apply_taylor_calibrate): 300 steps on every calibration row, AdamW
# (default betas) lr 1e-3 for gates / 1e-4 for q,k,v weights, weight decay 0.01, absolute MSE after
# o_proj, o_proj and o_norm frozen, gradient norm clipped to 1, bf16, lowest full-batch loss kept
PAPER_ALIGN = AlignSettings(steps=300, lr_gates=1e-3, lr_proj=1e-4, weight_decay=0.01, batch_rows=0, best_on="train",
                            loss="absolute", betas=(0.9, 0.999), groups="paper", dtype="bfloat16",
                            best_state="after_update")
# the authors' ga probes (scripts/greedy_layer_selection.py) align with lr 3e-3 for the gates, on
# 8 rows of 256 tokens
PAPER_GA_ALIGN = replace(PAPER_ALIGN, lr_gates=3e-3)
PAPER_GA_TOKENS = 2048
TAYLOR_FIT_ALIGN = AlignSettings(best_on="heldout")

register("naive", Strategy)
register("zero_gate", ZeroGate)
register("taylor", Taylor)
register("taylor_calibrate", lambda: Taylor(name="taylor_calibrate", readout_key="taylor", align=replace(PAPER_ALIGN)))
register("taylor_fit", lambda: TaylorFit(align=replace(TAYLOR_FIT_ALIGN)))
# taylor_fit's closed form with the fitted gate (no alignment): the fitted output gate; readout_gap reads its sums
_FITTED_GATE = "taylor_fit-closed"
register(_FITTED_GATE, lambda: TaylorFit(name=_FITTED_GATE, gate_fit=True,
                                         description="taylor_fit's closed form: output gate chosen from γ W_v and near-constant "
                                                     "γ 1 x̄ᵀ/|x̄|² candidates + joint OLS scales after o_proj; no alignment"))
# ablations of taylor_fit: one component changed at a time
register("taylor_fit-bias", lambda: TaylorFit(name="taylor_fit-bias", bias=False, align=replace(TAYLOR_FIT_ALIGN)))
register("taylor_fit-sinkfree", lambda: TaylorFit(name="taylor_fit-sinkfree", sink_free=False, align=replace(TAYLOR_FIT_ALIGN)))
register("taylor_fit-heldout", lambda: TaylorFit(name="taylor_fit-heldout", readout_key="taylor_fit",
                                                 align=replace(TAYLOR_FIT_ALIGN, best_on="train")))
# the two halves of the difference to taylor_calibrate: taylor_fit's closed form with the
# authors' alignment, and the authors' closed form with taylor_fit's alignment
register("taylor_fit-align", lambda: TaylorFit(name="taylor_fit-align", readout_key="taylor_fit", align=replace(PAPER_ALIGN)))
register("taylor_fit-init", lambda: Taylor(name="taylor_fit-init", readout_key="taylor", align=replace(TAYLOR_FIT_ALIGN),
                                          description="the authors' closed form aligned as taylor_fit"))
# aligned from the fitted gate, and that without the mean-input candidates
register("taylor_fit+gatefit", lambda: TaylorFit(name="taylor_fit+gatefit", gate_fit=True, readout_key=_FITTED_GATE,
                                                 align=replace(TAYLOR_FIT_ALIGN)))
register("taylor_fit-meangate", lambda: TaylorFit(name="taylor_fit-meangate", gate_fit=True, mean_gate=False,
                                                  readout_key=_FITTED_GATE, align=replace(TAYLOR_FIT_ALIGN)))
# taylor_fit aligned on the partly converted student's own inputs, bottom to top (sequential.py): the
# teacher's attention output, or its residual stream, as the target; same closed form and stats as taylor_fit
register("taylor_fit-seq", lambda: TaylorFit(name="taylor_fit-seq", readout_key="taylor_fit",
                                             align=replace(TAYLOR_FIT_ALIGN, forcing="student")))
register("taylor_fit-seqres", lambda: TaylorFit(name="taylor_fit-seqres", readout_key="taylor_fit",
                                                align=replace(TAYLOR_FIT_ALIGN, forcing="residual")))
