"""Headline numbers of a benchmark run: `python -m megatron_tc.bench.summary DIR`.

Reads the result files in DIR (JSON with a 'benchmark' key) (written by tools/bench/*.py) and prints,
compactly, the rows that docs/benchmarks.md needs: GDN timings against the SDPA anchors,
student/teacher ratios, MFU, statistics-pass ratio and calibration wall time, and every recorded
error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import markdown_table


def _load(directory: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"- {path.name}: unreadable ({exc})")
            continue
        if isinstance(data, dict) and "benchmark" in data:
            out[path.stem] = data
    return out


def summarize(directory: Path) -> str:
    runs = _load(directory)
    parts = [f"# headline numbers ({directory})"]
    for name, run in runs.items():
        env = run.get("env", {})
        peaks = run.get("peaks") or {}
        ceiling = (f", measured {peaks['matmul_tflops']:.0f} TFLOP/s matmul, {peaks['copy_gbps']:.0f} GB/s copy"
                   if peaks else "")
        parts.append(f"## {name}: {env.get('gpu', env.get('device'))}, {env.get('date')}, torch {env.get('torch')}, "
                     f"fla {env.get('fla')}, triton {env.get('triton')}{ceiling}")
        if run.get("benchmark") == "gdn":
            rows = [r for r in run.get("rows", []) if r.get("anchor_ms") or (r.get("T", 0) >= 32768 and "ms" in r)]
            parts.append(markdown_table(run.get("checks", []), ["method", "H", "D", "max_rel_err", "worst"]))
            parts.append(markdown_table(rows, ["H", "D", "B", "T", "pass", "method", "ms", "anchor_ms", "vs_sdpa",
                                               "note"]))
        elif run.get("benchmark") == "inference":
            parts.append(markdown_table(run.get("checks", []),
                                        ["model", "role", "rel_err", "rel_err_fp32", "bf16_vs_fp32"]))
            parts.append(markdown_table(run.get("summary", []),
                                        ["model", "metric", "teacher", "student", "ratio", "goal", "met"]))
            parts.append(markdown_table(run.get("decode", []),
                                        ["model", "role", "B", "eager_ms", "graph_ms", "static_eager_ms",
                                         "static_graph_ms", "floor_ms", "note"]))
        elif run.get("benchmark") == "train":
            parts.append(markdown_table(run.get("checks", []), ["model", "loss_rel_err", "grad_rel_err_global",
                                                                "bf16_chunk_grad_rel_err_global", "max_grad_rel_err",
                                                                "worst_param"]))
            parts.append(markdown_table(run.get("rows", []), ["model", "mode", "step_ms", "tok_per_s", "mfu", "busy_ms",
                                                              "peak_mem_GiB", "note"]))
            top = [r for model in dict.fromkeys(r["model"] for r in run.get("profile", []))
                   for r in [x for x in run["profile"] if x["model"] == model][:12]]
            if top:
                parts.append(markdown_table(top, ["model", "kernel", "ms_per_step", "share"]))
        elif run.get("benchmark") == "stats":
            parts.append(markdown_table(run.get("checks", []), ["check", "max_rel_err", "worst"]))
            parts.append(markdown_table(run.get("rows", []), ["pass", "tokens", "ms", "ratio", "goal", "met", "note"]))
            parts.append(markdown_table(run.get("calibrate", []), ["tokens", "warmup_s", "stats_s", "align_s", "wall_s",
                                                                   "met", "note"]))
        for error in run.get("errors", []):
            parts.append(f"- ERROR {error}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m megatron_tc.bench.summary DIR   (DIR holds the bench_*.json results)", file=sys.stderr)
        return 2
    print(summarize(Path(args[0])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
