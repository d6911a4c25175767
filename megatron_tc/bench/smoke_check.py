"""Checks of a finished multi-GPU smoke run (tools/bench/check_smoke.py): every stage complete on
the expected ranks, the precision, fla's kernels on CUDA, finite losses, the export; one line per
check."""
from __future__ import annotations

import json
import math
import os
import re
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
    if not rows:
        return False, "no rows"
    losses = [r.get("loss") for r in rows]
    for line, (row, loss) in enumerate(zip(rows, losses), start=1):
        # NaN/Infinity read back as floats; a null (or absent) loss reads back as None
        if not _is_finite_number(loss):
            where = f"step {row['step']}" if "step" in row else f"record {line}"
            return False, f"{len(rows)} logged steps, first non-finite at {where}: loss {loss!r}"
    return True, f"{len(rows)} logged steps, loss {losses[0]:.4g} -> {losses[-1]:.4g}"


def _is_finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def new_gdn_kernels(marker: Path) -> list[str]:
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    since = marker.stat().st_mtime
    names = {p.stem for p in cache.rglob("*.json") if p.stat().st_mtime >= since and not p.name.startswith("__grp__")}
    return sorted(n for n in names if GDN_KERNEL.search(n))


def launcher_check(log_path: Path, world: int, results: list[bool]) -> None:
    """DeepSpeed's launcher log names `dist_world_size=world` and `world` local slots."""
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    slots = re.search(r"WORLD INFO DICT: \{'localhost': \[([0-9, ]*)\]\}", log)
    n_slots = len(slots.group(1).split(",")) if slots and slots.group(1).strip() else 0
    named = f"dist_world_size={world}" in log
    check("deepspeed launcher", named and n_slots == world,
          f"dist_world_size={world} in log: {named}, local slots {n_slots}", results)


def cuda_checks(run: dict, kernels_since: Path | None, results: list[bool]) -> None:
    """A CUDA build of torch, fla importable, and (given a marker) fla's GDN kernels compiled since it."""
    torch_version = str(run.get("torch"))
    check("cuda torch", "+cu" in torch_version or "cuda" in torch_version, f"torch {run.get('torch')}", results)
    try:
        from megatron_tc.model.ops.gated_delta_rule import fla_available
        fla = fla_available()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        fla = False
        print(f"  fla import: {type(exc).__name__}: {exc}")
    check("fla available", fla, "GDN backend 'auto' = fla on CUDA tensors", results)
    if kernels_since is not None:
        kernels = new_gdn_kernels(kernels_since)
        if kernels:
            check("fla kernels compiled by the run", True, f"{len(kernels)}: {', '.join(kernels[:8])}", results)
        else:  # not a failure: a carried kernel cache may already hold every shape of the run
            print("WARN fla kernels compiled by the run: none new in $TRITON_CACHE_DIR (all cached?)", flush=True)


def check_smoke_run(run_dir: Path, log: Path, world: int, precision: str = "bf16", cuda: bool = False,
                    kernels_since: Path | None = None) -> int:
    """Every check, one line each, and a count; 0 when all pass, else 1."""
    results: list[bool] = []
    manifest_path = run_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    stages = {k: v.get("status") for k, v in manifest.get("stages", {}).items()}
    check("stages complete", bool(stages) and all(s == "complete" for s in stages.values()), str(stages), results)
    run = manifest.get("run", {})
    check("world size", run.get("world_size") == world, f"manifest {run.get('world_size')}, expected {world}",
          results)
    launcher_check(log, world, results)
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    run_precision = (config.get("run") or {}).get("precision")
    check("precision", run_precision == precision, f"config {run_precision}, expected {precision}", results)
    if cuda:
        cuda_checks(run, kernels_since, results)
    for stage in ("stage1", "stage2"):
        if stage in stages:
            ok, detail = finite_losses(run_dir / stage / "train_log.jsonl")
            check(f"{stage} losses finite", ok, detail, results)
    hf = run_dir / "export" / "hf"
    check("export", (hf / "config.json").is_file(), str(hf), results)
    print(f"{sum(results)}/{len(results)} checks passed", flush=True)
    return 0 if all(results) else 1
