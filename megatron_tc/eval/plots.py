"""PNG plots for reports (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import io
import os
from typing import Sequence

from megatron_tc.eval.tokens_to_target import RunCurve, Target


def _save_png(fig, path: str | os.PathLike) -> str:
    """Write, then rename (a crash never leaves half a PNG); closes the figure. The image is kept
    in a 256-colour palette: a line plot looks the same and takes a third of the bytes (the
    results pages' figures are committed)."""
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    path = str(path)
    tmp = f"{path}.tmp-{os.getpid()}.png"  # per process: grid lanes write the same table's plot
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(tmp, format="png", optimize=True)
    os.replace(tmp, path)
    return path


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
    return _save_png(fig, path)


def plot_grouped_bars(panels: dict[str, dict[str, dict[str, float]]], path: str | os.PathLike,
                      title: str, ylabel: str, reference: float | None = 1.0) -> str:
    """One panel per key of `panels`; in each, a group of bars per group key, one bar per series.

    `panels[panel][group][series] = value`; missing values leave a gap. The y axis is logarithmic
    (perplexity ratios span 1x to several 100x); `reference` draws a horizontal line (the teacher).
    Written atomically; returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    series = list(dict.fromkeys(s for groups in panels.values() for bars in groups.values() for s in bars))
    n_panels = max(len(panels), 1)
    fig, axes = plt.subplots(1, n_panels, figsize=(3.6 * n_panels + 1.2, 4.2), dpi=120, squeeze=False, sharey=True)
    width = 0.8 / max(len(series), 1)
    for ax, (panel, groups) in zip(axes[0], panels.items()):
        for i, name in enumerate(series):
            xs = [g for g, (_, bars) in enumerate(groups.items()) if name in bars]
            ys = [bars[name] for bars in groups.values() if name in bars]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], ys, width, label=name, color=f"C{i}")
        if reference is not None:
            ax.axhline(reference, color="black", lw=1.0)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_title(panel)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return _save_png(fig, path)
