"""Which part of a closed-form init helps or hurts per-layer alignment (docs/RESULTS.md, issue 10).

Two finished zero-shot grid cells of the same teacher and layer selection: `--base` (e.g. ours)
and `--donor` (e.g. taylor_calibrate). For each layer, aligns on the calibration rows and scores on
the held-out calibration rows, exactly as the init stage does:
  base, donor, and base with the donor's output gate + value scale / write strength / timescale.

    python tools/experiments/align_components.py --base CELL --donor CELL [--layers 0,1,2]

Prints one row per (layer, variant): held-out relative MSE before -> best (@ step) and the curve.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GROUPS = {"gate + value scale": ("g_proj", "o_proj", "o_norm"), "write strength": ("b_proj",),
          "timescale": ("A_log", "dt_bias", "a_proj")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="grid cell whose closed form is varied (e.g. ours)")
    ap.add_argument("--donor", type=Path, required=True, help="grid cell whose parts are swapped in (e.g. taylor_calibrate)")
    ap.add_argument("--layers", default="0", help="comma-separated converted layers")
    args = ap.parse_args()
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29731"}.items():
        os.environ.setdefault(key, value)

    from megatron_tc.calibrate.align import align_layer, collect_layer_io
    from megatron_tc.calibrate.statsfile import TaylorStats
    from megatron_tc.calibrate.strategies import get_strategy
    from megatron_tc.calibrate.student import build_student, converted_layers
    from megatron_tc.config import load_config
    from megatron_tc.distill.runner import _setup
    from megatron_tc.distill.stages import (_align_settings, _all_calibration_rows, heldout_calibration_tokens,
                                            read_selection)

    work = Path(tempfile.mkdtemp(prefix="align_components_")) / "cell"
    shutil.copytree(args.base, work)  # the run context writes its config into the run directory
    cfg = load_config(work / "config.yaml", [f"run.run_dir={work}"])
    ctx = _setup(cfg)
    teacher = ctx.teacher()
    pattern = read_selection(ctx)["pattern"].replace("|", "")
    donor_cfg = load_config(args.donor / "config.yaml", [f"run.run_dir={args.donor}"], check=False)
    if read_selection_of(args.donor) != pattern:
        raise SystemExit(f"{args.donor} converted other layers than {args.base}: compare cells of one selection")
    students, settings = {}, {}
    for role, cell, cell_cfg in (("base", args.base, cfg), ("donor", args.donor, donor_cfg)):
        strategy = get_strategy(cell_cfg.calibrate.init)
        stats = TaylorStats.load(cell / "stats" / "stats.pt", teacher_sha256=teacher.sha256,
                                 converted_layers=converted_layers(pattern))
        students[role] = build_student(teacher.model, pattern, strategy, stats, cfg.run.seed, teacher.sha256)
        settings[role] = cell_cfg.calibrate.init
    align = _align_settings(cfg, get_strategy("taylor_fit"))  # held-out best step, the config's rates
    layers = [int(x) for x in args.layers.split(",")]
    calib = _all_calibration_rows(ctx, cfg.data.calib_tokens)
    held = _all_calibration_rows(ctx, heldout_calibration_tokens(cfg), skip_tokens=cfg.data.calib_tokens)
    data, held_data = collect_layer_io(teacher.model, calib, layers), collect_layer_io(teacher.model, held, layers)
    variants = [(settings["base"], "base", ()), (settings["donor"], "donor", ())]
    variants += [(f"{settings['base']} with {settings['donor']}'s {g}", "base", parts) for g, parts in GROUPS.items()]
    for layer in layers:
        for label, role, swap in variants:
            mixer = copy.deepcopy(students[role].layers[layer].mixer)
            if swap:
                theirs = students["donor"].layers[layer].mixer.state_dict()
                mixer.load_state_dict({k: theirs[k] if k.split(".")[0] in swap else v for k, v in mixer.state_dict().items()})
            r = align_layer(mixer, data[layer], align, held_data[layer], seed=cfg.run.seed + layer)
            curve = " ".join(f"{v:.3f}" for _, v in r["curve"][::3])
            print(f"layer {layer:2d}  {label:58s} {r['initial']:.3f} -> {r['best']:.3f} @ {r['best_step']:3d}   {curve}",
                  flush=True)


def read_selection_of(cell: Path) -> str:
    import json

    return json.loads((cell / "select" / "selection.json").read_text())["pattern"].replace("|", "")


if __name__ == "__main__":
    main()
