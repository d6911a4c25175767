#!/usr/bin/env python
"""Experiment (not a registered strategy yet): `taylor_fit` with a near-constant output-gate candidate.

Why: the readout sums show that the *ungated* read of the closed-form recurrence explains more of
the teacher's attention output than any candidate gate SiLU(γ W_v x) of `taylor_fit` (the
elementwise gate by a value-like vector scrambles the read). A bias-free g_proj cannot be exactly
constant, but the rows  g_proj = γ · 1 x̄ᵀ/|x̄|²  (x̄ the mean mixer input of the calibration text)
give g_proj x_t = γ (x̄·x_t)/|x̄|², which is γ on average and near-constant where the inputs share
their mean direction — the same "mean input" device the paper uses for b_proj. The per-head choice
and the joint least squares of `taylor_fit` then pick between these and the γ W_v candidates.

    # 1. add the readout sums of the new strategy to a copy of the stats file, and compare the
    #    unexplained fraction per layer with taylor_fit, on the calibration rows and on held-out rows
    python tools/experiments/meangate.py readout --teacher T --text CAL --tokens 2048 --seq-len 512 \
        --stats R/stats.pt --heldout-tokens 512 --out R/stats_meangate.pt
    # 2. any tools/calibrate.py command line, with the strategies taylor_fit-meangate[-closed] known
    python tools/experiments/meangate.py calibrate --init taylor_fit-meangate --stats R/stats_meangate.pt ...
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

import torch

from megatron_tc.calibrate import strategies as S
from megatron_tc.calibrate.readout import solve_joint_scales

MEAN_GATE_GAMMAS = (1.0, 4.0, 16.0)


@dataclass
class TaylorFitMeanGate(S.TaylorFit):
    name: str = "taylor_fit-meangate"
    description: str = "taylor_fit + near-constant output-gate candidates γ·1 x̄ᵀ/|x̄|²"

    def _mean_direction(self, ctx: S.LayerContext) -> torch.Tensor:
        layer = S._stats(ctx).layer(ctx.index)
        mean = (layer["x_sum"] / layer["count"]).float()
        return mean / mean.pow(2).sum().clamp_min(1e-30)

    def gate_candidates(self, ctx: S.LayerContext, params: S.State) -> list:
        rows = ctx.arch.num_heads * ctx.arch.head_dim
        direction = self._mean_direction(ctx)
        extra = [gamma * direction[None, :].expand(rows, -1).clone() for gamma in MEAN_GATE_GAMMAS]
        return super().gate_candidates(ctx, params) + extra

    def finish(self, ctx: S.LayerContext, params: S.State, readout: dict) -> S.State:
        h, d = ctx.arch.num_heads, ctx.arch.head_dim
        candidates = self.gate_candidates(ctx, params)
        explained = readout["uy"].pow(2) / readout["uu"].clamp_min(1e-30)  # [C, H]
        choice = explained.argmax(dim=0)
        index = choice * h + torch.arange(h)
        scales = solve_joint_scales(readout["G"][index][:, index], readout["r"][index])
        weight = torch.cat([candidates[int(c)][i * d:(i + 1) * d] for i, c in enumerate(choice)])
        params["g_proj.weight"] = weight.to(params["g_proj.weight"].dtype)
        S.fold_head_scales(params, scales, d)
        return params


def register() -> None:
    if "taylor_fit-meangate" not in S.REGISTRY:
        S.register("taylor_fit-meangate", lambda: TaylorFitMeanGate(align=replace(S.OURS_ALIGN)))
        S.register("taylor_fit-meangate-closed",
                   lambda: TaylorFitMeanGate(name="taylor_fit-meangate-closed", readout_key="taylor_fit-meangate"))


def unexplained(readout: dict, heads: int, fit: dict | None = None) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Fraction of |Y|^2 the chosen candidates leave after the joint least squares. With `fit`
    (readout sums of other tokens), choice and scales come from `fit` and are scored on `readout`."""
    src = fit or readout
    explained = src["uy"].pow(2) / src["uu"].clamp_min(1e-30)
    index = explained.argmax(dim=0) * heads + torch.arange(heads)
    a = solve_joint_scales(src["G"][index][:, index], src["r"][index])
    G, r = readout["G"][index][:, index], readout["r"][index]
    resid = readout["YY"] - 2 * r @ a + a @ G @ a
    return float(resid / readout["YY"]), explained.argmax(dim=0), a


def readout_main(argv) -> int:
    from megatron_tc.calibrate.stats import collect_readout_stats
    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.calibrate.teacher_io import load_teacher, text_batches

    ap = argparse.ArgumentParser()
    for flag in ("--teacher", "--text", "--stats", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heldout-tokens", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    teacher = load_teacher(args.teacher)
    stats = TaylorStats.load(args.stats, teacher_sha256=teacher.sha256)
    student_arch = teacher.model.arch.with_pattern("G" * teacher.model.arch.num_layers)
    strategies = [S.get_strategy("taylor_fit-meangate")]
    calib = text_batches(args.text, teacher.tokenizer, args.tokens, args.seq_len)
    collect_readout_stats(stats, teacher.model, calib, strategies, student_arch, progress=False)
    stats.save(args.out)
    # held-out rows: the same closed forms, sums of both strategies on tokens the fit never saw
    held = TaylorStats.load(args.stats, teacher_sha256=teacher.sha256)
    held.meta["readout"] = {}
    held.sums = {k: v for k, v in held.sums.items() if not k.startswith("readout.")}
    hb = text_batches(args.text, teacher.tokenizer, args.heldout_tokens, args.seq_len, skip_tokens=args.tokens)
    collect_readout_stats(held, teacher.model, hb, [S.get_strategy("taylor_fit")] + strategies, student_arch,
                          progress=False)  # closed forms read the calibration stats (x̄, targets): same layers
    h = teacher.model.arch.num_heads
    rows = []
    for layer in stats.layers:
        row = {"layer": layer}
        for name in ("taylor_fit", "taylor_fit-meangate"):
            row[f"{name}/calib"] = round(unexplained(stats.readout(name, layer), h)[0], 4)
            row[f"{name}/heldout"] = round(
                unexplained(held.readout(name, layer), h, fit=stats.readout(name, layer))[0], 4)
        row["meangate_choice"] = unexplained(stats.readout("taylor_fit-meangate", layer), h)[1].tolist()
        rows.append(row)
    print(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    register()
    if len(sys.argv) > 1 and sys.argv[1] == "readout":
        return readout_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "calibrate":
        from megatron_tc.calibrate.cli import calibrate_main

        return calibrate_main(sys.argv[2:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
