#!/usr/bin/env python
"""The paper-reproduction grid driver: the grid files of configs/paper for some teachers, within a time budget.

    python tools/paper/grid.py grid --kind small --teacher qwen2=DIR [--teacher ...]
        [--out runs/paper/grid] [--variant taylor_fit] [--policies uniform,ar,stats] [--max-seconds 480]
        [--parts stage2,zero_shot] [--history ROOT ...] [--set key=value ...] [--quick]
    python tools/paper/grid.py quick-configs OUT_DIR   # tiny variants of the teacher configs
    python tools/paper/grid.py quick-overrides         # the --quick key=value list

`grid` runs configs/paper/grid_<kind>_<part>.yaml for each of --parts, by default stage2 (policy x
init with stage 2) and then zero_shot (zero_gate); on request naive_long (SmolLM2's naive with 4.5x the
stage-2 budget), stage2_seed and stage2_seed2 (SmolLM2's stage-2 grid with run.seed 1 and 2: the run-to-run spread) and
stage2_variant (taylor_fit alone with the grid's recipe: a variant named by --variant, compared with the grid's cells),
and the stage-2 recipes stage2_warmup (a 2-step warmup), stage2_gdn (that, training the GDN mixers only)
and stage2_lr (half the peak learning rate); faithful, faithful_seed1 (SmolLM2: naive, zero_gate,
taylor_calibrate, taylor_fit under uniform, ar, ga at 30M stage-2 tokens, run.seed 0 and 1) and
faithful_recipe (init, stage 1, stage 2 under uniform).
Each goes through megatron_tc.eval.grid, restricted to the named teachers (paths given here) and
policies, with `taylor_fit` replaced by --variant. Finished cells are skipped; cells that would not end within
--max-seconds stay pending (exit code 3) for the next call (how long a cell takes: this out dir's
finished cells, else those of the --history roots; the other stage-2 parts' cells take as long as stage2 ones).
A cell takes the converted teacher and the selection of any part's cell of its (teacher, policy), and the
statistics and init of one of its init too (another recipe: the calibrated start is made once).
Every cell's run directory links `data_cache` to one shared directory, so each tokenizer tokenizes
the corpus once. `--quick`: CPU sizes (fp32, 64-token rows, a few steps) for an end-to-end check.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.eval.paper_grid import KINDS, PARTS, QUICK, quick_configs, run  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid", help="run the grid cells of some teachers")
    g.add_argument("--kind", choices=KINDS, required=True, help="small: our pretrained teachers; smollm2: the GGUF")
    g.add_argument("--teacher", action="append", required=True, help="NAME=PATH (repeatable)")
    g.add_argument("--out", default=str(ROOT / "runs" / "paper" / "grid"))
    g.add_argument("--variant", default="taylor_fit",
                   help="the taylor_fit variant (a registry name) that stands in for taylor_fit")
    g.add_argument("--policies", default=None, help="comma-separated subset of the grid's policies")
    g.add_argument("--parts", default="stage2,zero_shot", help=f"comma-separated grids to run, of {list(PARTS)}")
    g.add_argument("--max-seconds", type=float, default=None)
    g.add_argument("--history", action="append", default=[], type=Path,
                   help="a grid root of earlier results (e.g. another machine's runs/paper/grid; "
                        "repeatable): its cells' times tell --max-seconds how long a cell takes before one of "
                        "this out dir has finished")
    g.add_argument("--set", action="append", default=[], help="extra key=value override for every cell")
    g.add_argument("--quick", action="store_true", help="CPU toy sizes (end-to-end check)")
    q = sub.add_parser("quick-configs", help="write tiny teacher configs of the three families")
    q.add_argument("out", type=Path)
    sub.add_parser("quick-overrides", help="print the --quick overrides (for tools/distill.py)")
    args = ap.parse_args(argv)
    if args.cmd == "quick-overrides":
        print(" ".join(QUICK))
        return 0
    if args.cmd == "quick-configs":
        for path in quick_configs(args.out):
            print(path)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
