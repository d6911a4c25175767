"""The authors' closed form (FutureMLS-Lab/Taylor-Calibrate, src/init_ckpt_calibrated.py) as the
`taylor` strategy: decay rates from the mean attention distance, write strengths from the heads'
entropy rank, an OLS value scale and a damped output gate (docs/method.md sections 4 and 7).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .moments import DENOMINATOR
from .statsfile import TaylorStats
from .strategy_base import (
    LayerContext, State, Strategy, StrategyError, copy_teacher, logit, meta_placeholder, require_stats, zeros_as,
)

PAPER_GATE_DAMPING = 0.01  # g_proj = alpha W_v with alpha 0.01 x (teacher RMS / gate RMS)
PAPER_SELF_DISTANCE = 0.5  # the query's own key counts as distance 0.5 (their `dist.clamp_min(0.5)`)
PAPER_MIN_DISTANCE = 0.5
PAPER_RATE_RANGE = (1e-3, 5.0)  # target decay rate g = ln2 / distance, clamped
PAPER_BETA_RANGE = (0.3, 0.7)  # write strength from the head's entropy rank within its layer
PAPER_ENTROPY_SPREAD = 1e-3  # floor of a layer's max - min mean head entropy
PAPER_VALUE_SCALE_RANGE = (0.1, 10.0)


def require_sums(ctx: LayerContext, sums: dict[str, torch.Tensor], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in sums]
    if missing:
        raise StrategyError(f"layer {ctx.index}: the stats file has no {what} {missing} that taylor needs; it was "
                            "written by an older version: recompute it with tools/stats.py (or the stats stage)")


def paper_mean_distance(stats: TaylorStats, index: int | Sequence[int]) -> torch.Tensor:
    """[H] mean over query tokens of sum_j p_ij max(i - j, 0.5), floored at 0.5; [L, H] for a
    sequence of L layers."""
    return (layer_means(stats, index, "dist") + PAPER_SELF_DISTANCE * layer_means(stats, index, "self")
            ).clamp_min(PAPER_MIN_DISTANCE)


def layer_means(stats: TaylorStats, index: int | Sequence[int], key: str) -> torch.Tensor:
    """`stats.mean(index, key)` [H]; for a sequence of L layers [L, H], each row that layer's own
    (the sums stacked, then one division)."""
    if isinstance(index, int):
        return stats.mean(index, key)
    layers = [stats.layer(i) for i in index]
    sums, counts = (torch.stack([layer[k] for layer in layers]) for k in (key, DENOMINATOR[key]))
    counts = counts.view(counts.shape + (1,) * (sums.dim() - counts.dim()))  # a layer's count: per layer
    return sums / counts.clamp_min(1.0)


def paper_decay_rate(distance: torch.Tensor) -> torch.Tensor:
    """[H] target -g = ln2 / distance (a half-life of `distance` tokens), clamped to [1e-3, 5]."""
    return (math.log(2.0) / distance).clamp(*PAPER_RATE_RANGE)


def softplus_inverse(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def paper_write_strength(entropy: torch.Tensor) -> torch.Tensor:
    """[H] beta* = 0.3 + 0.4 c, c = 1 - (e - min e) / max(max e - min e, 1e-3) over the layer's
    heads (e: mean attention entropy): the most concentrated head writes hardest. [L, H]: per row."""
    low, high = entropy.amin(dim=-1, keepdim=True), entropy.amax(dim=-1, keepdim=True)
    spread = (high - low).clamp_min(PAPER_ENTROPY_SPREAD)
    concentration = 1.0 - (entropy - low) / spread
    return PAPER_BETA_RANGE[0] + (PAPER_BETA_RANGE[1] - PAPER_BETA_RANGE[0]) * concentration


def paper_b_proj(weight: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Row h of the default b_proj [H, hidden] rescaled to mean |w| = logit(beta_h) / sqrt(hidden)
    (a negative logit flips the row's sign). This sets the row's scale, not the mean write strength.
    weight [L, H, hidden] and beta [L, H]: each layer's rows."""
    w = weight.double()
    row_mean = w.abs().mean(dim=-1, keepdim=True).clamp_min(1e-8)
    return (logit(beta.double()) / math.sqrt(w.shape[-1]))[..., None] * w / row_mean


def paper_value_scale(ry: torch.Tensor, rr: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[H] OLS scale of the raw recurrence read against the teacher's head output, clamped to
    [0.1, 10]. ry = sum <y, o>, rr = sum |o|^2 for our read o, whose query carries d^-1/2; the
    authors' read has no query scale (o' = sqrt(d) o), so their ratio is ry sqrt(d) / (rr d)."""
    num, den = ry * math.sqrt(head_dim), rr * head_dim
    return (num / den.clamp_min(1e-8)).clamp(*PAPER_VALUE_SCALE_RANGE)


def paper_gate_scale(y_rms_mean: torch.Tensor, silu_v_sq: torch.Tensor, tokens: float, head_dim: int) -> float:
    """alpha of g_proj = alpha W_v: 0.01 x (mean over tokens and heads of the teacher head output's
    RMS) / RMS of SiLU(v) over tokens, heads and channels (v after the value scale).
    y_rms_mean [H] per-head mean RMS; silu_v_sq [H] sum over tokens and channels of SiLU(v)^2."""
    teacher_rms = float(y_rms_mean.mean())
    gate_rms = math.sqrt(float(silu_v_sq.sum()) / (tokens * silu_v_sq.numel() * head_dim))
    return PAPER_GATE_DAMPING * teacher_rms / max(gate_rms, 1e-8)


def fold_value_scales(params: State, scales: torch.Tensor, head_dim: int) -> None:
    """Multiply the v_proj rows (and bias) of head h by scales[h] (k/v heads repeated to query heads)."""
    for key in ("v_proj.weight", "v_proj.bias"):
        if key in params:
            per_row = scales.to(params[key].dtype).repeat_interleave(head_dim)
            params[key] = params[key] * (per_row[:, None] if params[key].dim() == 2 else per_row)


@dataclass
class Taylor(Strategy):
    """The paper's closed form as the authors' code computes it (`_taylor_analytical_init` with
    `_calibrate_gates_inplace`; docs/method.md has the line-by-line correspondence)."""

    name: str = "taylor"
    needs_readout: bool = True
    description: str = ("the authors' closed form: A_log = 0, softplus(dt_bias) = ln2 / mean distance (self 0.5), "
                        "a_proj at init; b_proj rows rescaled from the entropy rank (beta* in [0.3, 0.7]); OLS value "
                        "scale on the raw read folded into v_proj; g_proj = alpha W_v")

    def closed_form(self, ctx: LayerContext) -> State:
        return self.closed_forms([ctx])[0]

    def closed_forms(self, ctxs: Sequence[LayerContext]) -> list[State]:
        """The layers' per-head rates and write strengths as [L, H] tensors: a few operators for
        all of them, not a few per layer (the host issues them while the device sums)."""
        if not ctxs:
            return []
        for ctx in ctxs:
            if ctx.arch.gdn_kv_heads != ctx.arch.num_heads:
                raise StrategyError(f"{self.name} scales values per query head: set gdn_expand_kv: true (the default)")
            require_sums(ctx, require_stats(ctx).layer(ctx.index), ("self", "y_rms"), "attention statistics")
        stats, indices = require_stats(ctxs[0]), [ctx.index for ctx in ctxs]
        dt_bias = softplus_inverse(paper_decay_rate(paper_mean_distance(stats, indices)))  # [L, H]
        beta = paper_write_strength(layer_means(stats, indices, "entropy"))
        b_proj = paper_b_proj(torch.stack([ctx.default["b_proj.weight"] for ctx in ctxs]), beta)
        # each layer's rows in the parameters' dtypes: one cast for all layers, then views
        dt_rows = dt_bias.to(meta_placeholder(ctxs[0].default, "dt_bias").dtype).unbind(0)
        b_rows = b_proj.to(meta_placeholder(ctxs[0].default, "b_proj.weight").dtype).unbind(0)
        out = []
        for ctx, dt_row, b_row in zip(ctxs, dt_rows, b_rows):
            # g_proj is set in finish; the gates' parameters here: none of their defaults is drawn
            params = copy_teacher(ctx, replaced=("g_proj.weight", "A_log", "dt_bias", "b_proj.bias"))
            params["A_log"] = zeros_as(params["A_log"])
            params["dt_bias"], params["b_proj.weight"] = dt_row, b_row
            if "b_proj.bias" in params:  # the authors' b_proj has no bias
                params["b_proj.bias"] = zeros_as(params["b_proj.bias"])
            out.append(params)
        return out

    def gate_candidates(self, ctx: LayerContext, params: State) -> list[torch.Tensor | None]:
        return [None]  # the raw read (ry, rr) does not depend on the output gate

    def finish(self, ctx: LayerContext, params: State, readout: dict[str, torch.Tensor]) -> State:
        require_sums(ctx, readout, ("ry", "rr", "vgrid"), "readout sums")
        from .readout import interpolate_value_grid

        d = ctx.arch.head_dim
        scales = paper_value_scale(readout["ry"], readout["rr"], d)
        fold_value_scales(params, scales, d)
        silu_v_sq = interpolate_value_grid(readout["vgrid"], scales)
        alpha = paper_gate_scale(require_stats(ctx).mean(ctx.index, "y_rms"), silu_v_sq, float(readout["count"]), d)
        params["g_proj.weight"] = (alpha * params["v_proj.weight"].double()).to(params["g_proj.weight"].dtype)
        return params
