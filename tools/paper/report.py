#!/usr/bin/env python
"""Tables and plots of the paper-reproduction grid from its result files.

    python tools/paper/report.py --runs DIR [--runs DIR ...] [--out DIR] [--variant taylor_fit]
        [--teachers smollm2,...] [--policies stats,...]

Several --runs roots are read as one grid (a cell in a later root replaces the same cell in an
earlier one), so a grid run in parts can be reported as one. --teachers / --policies restrict the
report (and its list of cells not finished) to part of the grid. Reads runs/pretrain/<teacher>/
(pretraining curves), runs/grid/stage2/<teacher>/<policy>/<init>/ (stage-2 cells: eval_log.jsonl,
eval/results.json) and runs/grid/zero_shot/... (zero_gate cells), and writes OUT/README.md
(pretraining, zero-shot and tokens-to-target tables with ratios and the goals checked cell by cell;
runs/grid/naive_long, runs/grid/stage2_seed{,2} and the other stage-2 recipes' cells,
runs/grid/stage2_{warmup,gdn,lr}, in sections of their own), OUT/pretrain_curves.png and, per
teacher x policy, OUT/<teacher>_<policy>/ (megatron_tc.eval.report: report.md, ppl_vs_tokens.png,
tokens_to_target.json). Cells that are missing or failed are listed, never guessed.
"""
import argparse
import sys
from pathlib import Path

from megatron_tc.config.errors import command_line
from megatron_tc.eval.paper_cells import POLICIES, TEACHERS
from megatron_tc.eval.paper_report import parse_names, write_paper_report


@command_line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, action="append",
                    help="a results root (repeatable; default runs/paper)")
    ap.add_argument("--out", type=Path, default=Path("runs/paper/report"))
    ap.add_argument("--variant", default="taylor_fit")
    ap.add_argument("--teachers", default=",".join(TEACHERS), help="comma list: the teachers to report")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list: the policies to report")
    ap.add_argument("--grid-eval-logs", type=Path, action="append", default=[],
                    help="a dir of <teacher>_<policy>_<init>_eval_log.jsonl: grid cells kept only as curves, read "
                         "where no cell of the grid is in --runs by every section, the zero-shot table with "
                         "their step-0 evaluation (repeatable)")
    args = ap.parse_args(argv)
    teachers = parse_names(args.teachers, TEACHERS, "teachers")
    policies = parse_names(args.policies, POLICIES, "policies")
    print(write_paper_report(args.runs or [Path("runs/paper")], args.out, args.variant, teachers, policies,
                             args.grid_eval_logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
