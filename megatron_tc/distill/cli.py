"""Command line of tools/distill.py: the config, key=value overrides, --force, --stop-after."""
from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        prog="tools/distill.py", description="Run the megatron_tc pipeline the config's run.stages names.",
        epilog="Overrides are dotted keys, e.g. distill.stage2.steps=100 parallel.tp=2 (see docs/configuration.md).")
    ap.add_argument("--force", default="", help="comma-separated stages to rerun from scratch, or 'all'")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop a training stage after this many steps (checkpointed; rerun to resume)")
    args, rest = ap.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("--")]
    if flags:
        ap.error(f"unknown option(s) {flags}")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    import megatron_tc.calibrate.strategies  # noqa: F401  (registers every init, ablations included, before the check)
    from megatron_tc.config import ConfigError, load_config, split_cli_args

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path, overrides = split_cli_args(rest)
        cfg = load_config(path, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from megatron_tc.distill.runner import StoppedBySignal, run_pipeline
    from megatron_tc.parallel.state import shutdown_distributed

    force = [s.strip() for s in args.force.split(",") if s.strip()]
    try:
        run_pipeline(cfg, force=force, stop_after=args.stop_after)
    except ConfigError as err:  # checks that need the world size or the teacher
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except StoppedBySignal as stop:  # the code a shell gives a process the signal ended: not finished
        print(str(stop), file=sys.stderr)
        shutdown_distributed()
        return 128 + stop.signum
    shutdown_distributed()
    return 0
