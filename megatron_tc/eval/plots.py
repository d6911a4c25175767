"""PNG plots for reports (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import os
from typing import Sequence

from megatron_tc.eval.tokens_to_target import RunCurve, Target


def plot_ppl_vs_tokens(curves: Sequence[RunCurve], targets: Sequence[Target], path: str | os.PathLike,
                       title: str = "Stage-2 eval perplexity", teacher_ppl: float | None = None) -> str:
    """Eval perplexity against training tokens (log-log) per run, targets as dashed lines.

    The zero-shot point (tokens = 0) cannot sit on a log axis: it is drawn as a hollow marker at the
    left edge (half the smallest positive token count) and joined to the curve with a dotted line.
    Written atomically; returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positive = [t for c in curves for t in c.tokens if t > 0]
    left = min(positive) / 2 if positive else 1.0
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for curve in curves:
        pts = [(t, p) for t, p in zip(curve.tokens, curve.ppl) if t > 0]
        line = None
        if pts:
            (line,) = ax.plot(*zip(*pts), marker="o", markersize=3, label=curve.name)
        if curve.zero_shot_ppl is not None:
            color = line.get_color() if line is not None else None
            ax.plot([left], [curve.zero_shot_ppl], marker="o", mfc="none", color=color,
                    label=None if line is not None else f"{curve.name} (zero-shot)")
            if pts:
                ax.plot([left, pts[0][0]], [curve.zero_shot_ppl, pts[0][1]], ls=":", color=color)
    for i, target in enumerate(targets):
        ax.axhline(target.ppl, ls="--", lw=0.8, color=f"C{(i + 5) % 10}", label=f"target: {target.label}")
    if teacher_ppl is not None:
        ax.axhline(teacher_ppl, ls="-", lw=1.0, color="black", label="teacher")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (zero-shot at the left edge)")
    ax.set_ylabel("eval perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = str(path)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
