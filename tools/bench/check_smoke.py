#!/usr/bin/env python
"""Check a finished `bash launch/distill.sh` run (e.g. configs/gpu_smoke.yaml) for what a
multi-GPU smoke test must show, and print one line per check:

    python tools/bench/check_smoke.py RUN_DIR --log LAUNCH_LOG --world N [--precision bf16]
        [--cuda] [--kernels-since MARKER]

  every stage of the manifest 'complete', run on N ranks (manifest and DeepSpeed's launcher log:
  `dist_world_size=N`, N local slots); the config's precision; --cuda: torch is a CUDA build, fla
  imports, and (with --kernels-since) fla's GDN Triton kernels were compiled into
  $TRITON_CACHE_DIR after MARKER was touched (the run used fla: nothing else compiles them);
  stage-1/2 losses finite; the exported HF directory exists. Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import yaml

GDN_KERNEL = re.compile(r"(delta|gated|chunk_|wy_|solve_tril|fwd_h|bwd_dh|recurrent)", re.IGNORECASE)


def check(name: str, ok: bool, detail: str, results: list[bool]) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    results.append(ok)


def finite_losses(path: Path) -> tuple[bool, str]:
    if not path.is_file():
        return False, f"{path} missing"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [r.get("loss") for r in rows]
    ok = bool(rows) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)
    return ok, f"{len(rows)} logged steps, loss {losses[0]:.4g} -> {losses[-1]:.4g}" if rows else "no rows"


def new_gdn_kernels(marker: Path) -> list[str]:
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    since = marker.stat().st_mtime
    names = {p.stem for p in cache.rglob("*.json") if p.stat().st_mtime >= since and not p.name.startswith("__grp__")}
    return sorted(n for n in names if GDN_KERNEL.search(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--log", type=Path, required=True, help="stdout+stderr of launch/distill.sh")
    ap.add_argument("--world", type=int, required=True, help="expected ranks (the visible GPUs)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--kernels-since", type=Path, default=None)
    args = ap.parse_args(argv)
    results: list[bool] = []
    manifest = json.loads((args.run_dir / "manifest.json").read_text()) if (args.run_dir / "manifest.json").is_file() else {}
    stages = {k: v.get("status") for k, v in manifest.get("stages", {}).items()}
    check("stages complete", bool(stages) and all(s == "complete" for s in stages.values()), str(stages), results)
    run = manifest.get("run", {})
    check("world size", run.get("world_size") == args.world, f"manifest {run.get('world_size')}, expected {args.world}",
          results)
    log = args.log.read_text(errors="replace") if args.log.is_file() else ""
    slots = re.search(r"WORLD INFO DICT: \{'localhost': \[([0-9, ]*)\]\}", log)
    n_slots = len(slots.group(1).split(",")) if slots and slots.group(1).strip() else 0
    check("deepspeed launcher", f"dist_world_size={args.world}" in log and n_slots == args.world,
          f"dist_world_size={args.world} in log: {f'dist_world_size={args.world}' in log}, local slots {n_slots}", results)
    config = yaml.safe_load((args.run_dir / "config.yaml").read_text()) if (args.run_dir / "config.yaml").is_file() else {}
    precision = (config.get("run") or {}).get("precision")
    check("precision", precision == args.precision, f"config {precision}, expected {args.precision}", results)
    if args.cuda:
        check("cuda torch", "+cu" in str(run.get("torch")) or "cuda" in str(run.get("torch")), f"torch {run.get('torch')}",
              results)
        try:
            from megatron_tc.model.ops.gated_delta_rule import fla_available
            fla = fla_available()
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            fla = False
            print(f"  fla import: {type(exc).__name__}: {exc}")
        check("fla available", fla, "GDN backend 'auto' = fla on CUDA tensors", results)
        if args.kernels_since is not None:
            kernels = new_gdn_kernels(args.kernels_since)
            if kernels:
                check("fla kernels compiled by the run", True, f"{len(kernels)}: {', '.join(kernels[:8])}", results)
            else:  # not a failure: a carried kernel cache may already hold every shape of the run
                print("WARN fla kernels compiled by the run: none new in $TRITON_CACHE_DIR (all cached?)", flush=True)
    for stage in ("stage1", "stage2"):
        if stage in stages:
            ok, detail = finite_losses(args.run_dir / stage / "train_log.jsonl")
            check(f"{stage} losses finite", ok, detail, results)
    hf = args.run_dir / "export" / "hf"
    check("export", (hf / "config.json").is_file(), str(hf), results)
    print(f"{sum(results)}/{len(results)} checks passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
