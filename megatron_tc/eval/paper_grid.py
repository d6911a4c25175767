"""The paper-reproduction grid driver (tools/paper/grid.py): the grid files of configs/paper for
some teachers and policies, part after part, within a time budget; cells share the converted
teacher, the selection and the calibrated start across parts, and one tokenized-data cache."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from megatron_tc.config.errors import InputError

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "paper"
KINDS = ("small", "smollm2")
# grid_<kind>_<part>.yaml; not every kind has every part
PARTS = ("stage2", "zero_shot", "naive_long", "stage2_seed", "stage2_seed2", "stage2_variant", "stage2_warmup",
         "stage2_gdn",
         "stage2_lr", "faithful", "faithful_seed1", "faithful_recipe")
# a part whose cells take as long as another part's (for --history)
TIMED_LIKE = {part: "stage2" for part in PARTS if part.startswith("stage2_")}

# CPU end-to-end check: every stage and every code path of the GPU run, at toy sizes.
QUICK = [
    "run.device=cpu", "run.precision=fp32", "data.seq_len=64", "data.micro_batch_size=4", "data.global_batch_size=4",
    "data.calib_tokens=512", "data.eval_tokens=1024", "calibrate.align_steps=4", "calibrate.align_tokens=512",
    "calibrate.stats_chunk_size=32", "distill.stage2.tokens=2048", "distill.stage2.warmup_steps=1",
    "distill.eval_interval=2", "distill.checkpoint_interval=4", "logging.log_interval=1",
    "pretrain.tokens=7680", "pretrain.warmup_steps=2", "pretrain.lr=5.0e-3",
]
# Tiny teachers of the same families (4 layers: 1 kept) for the quick check.
QUICK_TEACHER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
QUICK_HEADS = {"qwen2": (2, 1, None), "mistral": (2, 1, 32), "qwen3": (2, 1, 32)}  # heads, kv heads, head_dim


def quick_configs(out: Path) -> list[Path]:
    """configs/paper/teacher_<family>.json shrunk to QUICK_TEACHER (same family features)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for family, (heads, kv, head_dim) in QUICK_HEADS.items():
        config = json.loads((CONFIGS / f"teacher_{family}.json").read_text())
        config.update(QUICK_TEACHER, num_attention_heads=heads, num_key_value_heads=kv)
        if head_dim is not None:
            config["head_dim"] = head_dim
        if "sliding_window" in config:
            config["sliding_window"] = 16  # below the quick rows' 64 tokens, so the window matters
        path = out / f"teacher_{family}.json"
        path.write_text(json.dumps(config, indent=1) + "\n")
        written.append(path)
    return written


def narrowed(grid, teachers: dict[str, str], policies: list[str] | None, fit: str, out: Path, extra: list[str]):
    """The grid restricted to `teachers` (name -> path) and `policies`, taylor_fit -> fit, out -> out."""
    unknown = sorted(set(teachers) - set(grid.axes["teacher"]))
    if unknown:
        raise InputError(f"error: --teacher: teachers {unknown} are not in the grid's axis {sorted(grid.axes['teacher'])}")
    axes = dict(grid.axes)
    axes["teacher"] = {name: os.path.abspath(path) for name, path in teachers.items()}
    axes["policy"] = [p for p in grid.axes["policy"] if policies is None or p in policies]
    axes["init"] = [fit if i == "taylor_fit" else i for i in grid.axes["init"]]
    return dataclasses.replace(grid, axes=axes, out=str(out), overrides=[*grid.overrides, *extra])


def link_shared_cache(grid, shared: Path) -> None:
    """<cell>/data_cache -> shared (keys name tokenizer + documents, so sharing is safe)."""
    shared.mkdir(parents=True, exist_ok=True)
    for cell in grid.cells():
        link = Path(cell.run_dir) / "data_cache"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists() and not link.is_symlink():
            try:
                link.symlink_to(shared.resolve(), target_is_directory=True)
            except FileExistsError:  # another lane made it
                pass


def donors_of(grids: dict, part: str) -> list:
    """The cells of every part but `part`: those whose converted teacher and selection (any init) or
    statistics and init (the same init) `part`'s cells take when they start. The ar policy's selection
    costs 40-170 s of device time and an alignment 90-180 s; neither depends on the budget or the
    stage-2 recipe."""
    return [cell for other, grid in grids.items() if other != part for cell in grid.cells()]


def part_files(kind: str, parts: list[str]) -> dict[str, Path]:
    """part -> grid file for every part of `kind` (the requested ones must exist)."""
    files = {p: CONFIGS / f"grid_{kind}_{p}.yaml" for p in PARTS if (CONFIGS / f"grid_{kind}_{p}.yaml").is_file()}
    wrong = [p for p in parts if p not in files]
    if wrong:
        raise InputError(f"error: --parts {','.join(wrong)}: no such grid for kind {kind!r} "
                         f"(configs/paper has {sorted(files)} for it)")
    return files


def run(args: argparse.Namespace) -> int:
    import megatron_tc.calibrate.strategies  # noqa: F401  (registers every strategy name before configs are checked)
    from megatron_tc.eval.grid import UNFINISHED, load_grid, run_grid

    teachers = dict(t.split("=", 1) for t in args.teacher)
    policies = args.policies.split(",") if args.policies else None
    extra = [*(QUICK if args.quick else []), *args.set]
    started = time.perf_counter()
    status = 0
    out = Path(args.out).resolve()
    parts = args.parts.split(",")
    grids = {part: narrowed(load_grid(path), teachers, policies, args.variant, out / part, extra)
             for part, path in part_files(args.kind, parts).items()}
    for part in parts:
        grid = grids[part]
        left = None if args.max_seconds is None else args.max_seconds - (time.perf_counter() - started)
        link_shared_cache(grid, out / "data_cache")
        budget = "no" if left is None else f"{left:.0f} s"
        print(f"== {part}: {len(grid.cells())} cells, {budget} time budget", flush=True)
        records = run_grid(grid, max_seconds=left if left is None else max(left, 0.0),
                           history=[str(h / TIMED_LIKE.get(part, part)) for h in args.history],
                           donors=donors_of(grids, part))
        if any(r["status"] == "failed" for r in records):
            status = 1
        elif any(r["status"] in UNFINISHED for r in records) and status == 0:
            status = 3
        count = {s: sum(r["status"] == s for r in records) for s in ("ok", *UNFINISHED, "failed")}
        print(f"   {count['ok']} ok, {count['pending']} pending, {count['elsewhere']} running elsewhere, "
              f"{count['failed']} failed -> {grid.out}/results.md", flush=True)
    from megatron_tc.parallel.state import shutdown_distributed

    shutdown_distributed()  # the inline cells' process group
    return status
