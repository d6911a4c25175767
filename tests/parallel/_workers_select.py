"""Workers of tests/parallel/test_select_stage.py: the pipeline's `select` stage with `ga` and `ar`
on configs/tiny.yaml, with a whole (replicated) teacher on every rank."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GA_ALIGN_STEPS = 3  # the authors' 300 probe alignment steps, shortened for the tests
POLICIES = ("ga", "ar")


def shorten_ga_alignment() -> None:
    from megatron_tc.calibrate import strategies

    strategies.PAPER_GA_ALIGN = replace(strategies.PAPER_GA_ALIGN, steps=GA_ALIGN_STEPS)


def run_config(assets: str, run_dir: Path, policy: str, world_size: int):
    """configs/tiny.yaml converting <assets>/teacher and selecting 2 of its 4 layers with `policy`."""
    from megatron_tc.config import load_config

    overrides = [f"model.teacher={Path(assets) / 'teacher'}", f"data.source.paths=[{Path(assets) / 'text'}]",
                 "data.source.split_by=file", f"run.run_dir={run_dir}", "run.stages=[convert,select]",
                 f"model.policy={policy}", "model.keep_count=2"]
    return load_config(ROOT / "configs" / "tiny.yaml", overrides, world_size=world_size)


def select_stage(rank: int, world_size: int, assets: str, out: str) -> None:
    """run_pipeline: convert + select(ga), then select(ar) forced, in <out>/run{world_size}; every
    rank writes what the stage returned to it and the selection file as <out>/select{world_size}.{rank}.json
    {policy: {"summary", "selection"}}."""
    from megatron_tc.distill.runner import run_pipeline

    shorten_ga_alignment()
    records = {}
    for policy in POLICIES:
        cfg = run_config(assets, Path(out) / f"run{world_size}", policy, world_size)
        summary = run_pipeline(cfg, force=["select"])["select"]
        selection = json.loads((Path(cfg.run.run_dir) / "select" / "selection.json").read_text())
        records[policy] = {"summary": summary, "selection": selection}
    Path(out, f"select{world_size}.{rank}.json").write_text(json.dumps(records))
    dist.barrier()


def select_in_one_process(assets: str, run_dir: Path) -> dict:
    """The convert and select stages in this process, a world of one without a process group:
    {policy: the selection file} (ga's probe alignment as long as the caller has set it)."""
    from megatron_tc.distill import stages
    from megatron_tc.distill.context import RunContext
    from megatron_tc.distill.rundir import RunPaths
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import ParallelContext

    par = ParallelContext(rank=0, world_size=1, tp_size=1, tp_rank=0, tp_group=None, pp_size=1, pp_rank=0,
                          pp_group=None, dp_size=1, dp_rank=0, dp_group=None, mp_group=None)
    selections = {}
    for policy in POLICIES:
        cfg = run_config(assets, run_dir, policy, 1)
        ctx = RunContext(cfg, RunPaths.from_config(cfg), par, torch.device("cpu"), tb=TBWriter("", enabled=False))
        if policy == POLICIES[0]:
            stages.run_convert(ctx)
        stages.run_select(ctx)
        selections[policy] = json.loads(ctx.paths.selection.read_text())
    return selections
