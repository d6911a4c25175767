"""What every initialization strategy shares: the layer context it reads, the alignment settings,
the teacher copy, and the base `Strategy` (`naive`) with its phases (closed form, gate candidates,
finish). The strategies themselves are registered in `strategies.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from megatron_tc.model.config import ArchConfig

from .statsfile import TaylorStats

State = dict[str, torch.Tensor]


class StrategyError(ValueError):
    """A strategy that cannot be applied (unknown name, missing bias, missing readout sums)."""


@dataclass
class LayerContext:
    """Everything a strategy may read for converted layer `index`. teacher: the teacher mixer's
    unsharded state dict (q_proj.weight, ...), on the teacher's device while the statistics pass
    builds its readout mixers, else on the CPU; default: a default-initialized GDN mixer state
    (`default_gdn_state`; the strategies of one layer may share it: read it, never change it in
    place) and stats, always on the CPU. A strategy's output may mix the two devices (it is loaded into a
    module), but one operation must not: bring a CPU tensor to the teacher's with `.to(w.device)`."""

    index: int
    arch: ArchConfig
    teacher: State
    default: State
    stats: TaylorStats | None = None
    # the strategy's output is only read (the statistics pass's readout mixers): the teacher's and
    # the default's tensors it keeps as they are may be shared instead of copied
    read_only: bool = False


@dataclass
class AlignSettings:
    """Per-layer alignment (align.py). best_on: 'train' (the lowest training loss, the authors'
    choice) or 'heldout' (lowest loss on held-out calibration tokens, taylor_fit's)."""

    steps: int = 300
    lr_gates: float = 3e-3
    lr_proj: float = 3e-4
    weight_decay: float = 0.0
    batch_rows: int = 1  # rows per step; 0 = every calibration row each step (the authors')
    eval_every: int = 10
    best_on: str = "heldout"
    schedule: str = "constant"  # or "cosine": both learning rates decay to 0 at the last step
    # inputs the layers train on: 'teacher' (the teacher's, every layer at once: align.py), or the
    # partly converted student's, bottom to top, with the teacher's attention output ('student') or
    # the teacher's residual stream ('residual') as the target (sequential.py)
    forcing: str = "teacher"
    loss: str = "relative"  # 'relative': mean|out - y|^2 / mean|y|^2; 'absolute': mean|out - y|^2
    betas: tuple[float, float] = (0.9, 0.95)
    # 'taylor_fit': gates (a/b/g_proj, A_log, dt_bias) at lr_gates, every other parameter (o_proj and
    # o_norm included) at lr_proj with weight_decay; 'paper': q/k/v_proj weights at lr_proj, every
    # other parameter but o_proj and o_norm at lr_gates, both with weight_decay; o_proj, o_norm frozen
    groups: str = "taylor_fit"
    dtype: str = "float32"  # or 'bfloat16': the mixer, its inputs and targets in bf16 while aligning
    # with best_on='train', which parameters the lowest training loss keeps: 'before_update' (the
    # ones it was measured on; the closed form is a candidate) or 'after_update' (the authors' loop
    # records that loss, then keeps the parameters after that step's update)
    best_state: str = "before_update"


def expand_kv(weight: torch.Tensor, arch: ArchConfig, share: bool = False) -> torch.Tensor:
    """[Hkv*D, ...] -> [gdn_kv_heads*D, ...]: each KV head repeated to its query heads (GQA); a
    new tensor, or with `share` `weight` itself where nothing is repeated."""
    if arch.gdn_kv_heads == arch.num_kv_heads:
        return weight if share else weight.clone()
    group = arch.gdn_kv_heads // arch.num_kv_heads
    heads = weight.reshape(arch.num_kv_heads, arch.head_dim, *weight.shape[1:])
    return heads.repeat_interleave(group, dim=0).reshape(arch.gdn_kv_heads * arch.head_dim, *weight.shape[1:])


def value_per_query_head(ctx: LayerContext) -> torch.Tensor:
    """Teacher v_proj with KV heads repeated to all query heads: [H*D, hidden]."""
    arch = ctx.arch
    return expand_kv(ctx.teacher["v_proj.weight"], replace(arch, gdn_expand_kv=True))


def copy_teacher(ctx: LayerContext, replaced: tuple[str, ...] = ()) -> State:
    """q/k/v/o projections (and q/k/v biases) from the teacher, GQA-expanded; the rest default
    (the defaults of what the teacher replaces are never read: DefaultGDNState does not draw them).
    replaced: parameters the strategy sets itself from other values (in its closed form or
    finish): they hold `meta` placeholders of their shape and dtype, their defaults never drawn.
    With `ctx.read_only` the values are the teacher's and the default's tensors themselves (no
    copy, on the device no kernel) where nothing changes them."""
    keep = (lambda tensor: tensor) if ctx.read_only else torch.Tensor.clone
    copied = {f"{name}_proj.{kind}" for name in "qkvo" for kind in ("weight", "bias")}
    params = {k: None if k in copied else meta_placeholder(ctx.default, k) if k in replaced else keep(ctx.default[k])
              for k in ctx.default}  # the default's key order
    params["q_proj.weight"] = keep(ctx.teacher["q_proj.weight"])
    params["o_proj.weight"] = keep(ctx.teacher["o_proj.weight"])
    for name in ("k", "v"):
        params[f"{name}_proj.weight"] = expand_kv(ctx.teacher[f"{name}_proj.weight"], ctx.arch, ctx.read_only)
    if ctx.arch.attention_bias:
        params["q_proj.bias"] = keep(ctx.teacher["q_proj.bias"])
        for name in ("k", "v"):
            params[f"{name}_proj.bias"] = expand_kv(ctx.teacher[f"{name}_proj.bias"], ctx.arch, ctx.read_only)
    return params


def meta_placeholder(default: State, key: str) -> torch.Tensor:
    """An empty `meta` tensor shaped and typed as default[key], without drawing it."""
    like = default.layout[key] if hasattr(default, "layout") else default[key]
    return torch.empty(like.shape, dtype=like.dtype, device="meta")


def zeros_as(placeholder: torch.Tensor) -> torch.Tensor:
    """Zeros on the CPU, shaped and typed as `placeholder` (`copy_teacher`'s `meta` tensors too)."""
    return torch.zeros(placeholder.shape, dtype=placeholder.dtype)


def require_stats(ctx: LayerContext) -> TaylorStats:
    if ctx.stats is None:
        raise StrategyError(f"layer {ctx.index}: this strategy needs Taylor statistics (run tools/stats.py)")
    return ctx.stats


def set_half_life(params: State, half_life: torch.Tensor) -> None:
    """Constant decay a = 2^(-1/half_life) per head: a_proj = 0, A_log = 0, softplus(dt_bias) = ln2/h."""
    rate = math.log(2.0) / half_life.double()
    params["a_proj.weight"] = torch.zeros_like(params["a_proj.weight"])
    params["A_log"] = torch.zeros_like(params["A_log"])
    params["dt_bias"] = torch.log(torch.expm1(rate)).to(params["dt_bias"].dtype)


def logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


def fold_head_scales(params: State, scales: torch.Tensor, head_dim: int) -> None:
    """Multiply the o_proj columns of head h by scales[h]."""
    weight = params["o_proj.weight"]
    per_column = scales.to(weight.dtype).repeat_interleave(head_dim)
    params["o_proj.weight"] = weight * per_column[None, :]


@dataclass
class Strategy:
    """Base: `naive`. Subclasses override closed_form / gate_candidates / finish."""

    name: str = "naive"
    needs_readout: bool = False
    align: AlignSettings | None = None
    readout_key: str | None = None  # whose readout sums apply (ablations sharing a closed form)
    # closed_form keeps v_proj as copy_teacher makes it (teacher k/v heads repeated to query
    # heads): the readout's value grid is then summed once per teacher k/v head
    values_repeat_kv: bool = True
    description: str = "copy q/k/v/o (GQA-expanded); GDN-only parameters at their default init"

    @property
    def readout_name(self) -> str:
        return self.readout_key or self.name

    @property
    def readout_products(self) -> bool:
        """Whether `finish` reads the readout sums after o_proj (G, r, YY): sweep 2 computes them
        only for closed forms whose strategy says so (the largest part of its work)."""
        return False

    def check_stats(self, stats: TaylorStats | None) -> None:
        """Raise StatsMismatchError, before any work, when `stats` lack readout sums `finish` reads."""
        if self.needs_readout and self.readout_products and stats is not None:
            stats.check_readout_products(self.readout_name, self.name)

    def closed_form(self, ctx: LayerContext) -> State:
        return copy_teacher(ctx)

    def closed_forms(self, ctxs: Sequence[LayerContext]) -> list[State]:
        """`closed_form` of several layers (the statistics pass builds a group at once); a strategy
        may compute them together, each layer's values its own."""
        return [self.closed_form(ctx) for ctx in ctxs]

    def gate_candidates(self, ctx: LayerContext, params: State) -> list[torch.Tensor | None]:
        return []

    def finish(self, ctx: LayerContext, params: State, readout: dict[str, torch.Tensor]) -> State:
        return params

    def init_layer(self, ctx: LayerContext) -> State:
        self.check_stats(ctx.stats)
        params = self.closed_form(ctx)
        if self.needs_readout:
            params = self.finish(ctx, params, require_stats(ctx).readout(self.readout_name, ctx.index))
        unset = [key for key, value in params.items() if value is None or value.is_meta]
        if unset:
            raise StrategyError(f"strategy {self.name!r} left {unset} of layer {ctx.index} unset")
        return params


@dataclass
class ZeroGate(Strategy):
    name: str = "zero_gate"
    description: str = "naive with g_proj = 0: SiLU(0) = 0, converted layers start silent"

    def closed_form(self, ctx: LayerContext) -> State:
        params = copy_teacher(ctx)
        params["g_proj.weight"] = torch.zeros_like(params["g_proj.weight"])
        return params
