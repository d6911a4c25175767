"""Command line of tools/distill.py: the config, key=value overrides, --force, --stop-after."""
from __future__ import annotations

import argparse
import gc
import sys
import time


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


# A peer's process ending mid-collective, as gloo and NCCL report it on the ranks left waiting.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "Broken pipe",
             "NCCL communicator was aborted", "ProcessGroupNCCL's watchdog")
PEER_EXIT_GRACE_S = 3.0


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (a path, a config value, a damaged file): reported as one
    line, without a traceback. Anything else is a defect and keeps its traceback."""
    from megatron_tc.calibrate.statsfile import StatsMismatchError
    from megatron_tc.calibrate.strategies import StrategyError
    from megatron_tc.config import ConfigError
    from megatron_tc.convert.errors import CheckpointError, ConversionError
    from megatron_tc.data.documents import DataError
    from megatron_tc.distill.checkpointing import CheckpointError as TrainCheckpointError
    from megatron_tc.distill.rundir import RunDirError
    from megatron_tc.model.config import ArchConfigError

    return (ConfigError, ConversionError, CheckpointError, TrainCheckpointError, DataError, StatsMismatchError,
            StrategyError, ArchConfigError, RunDirError, FileNotFoundError)


def peer_failed(err: BaseException) -> bool:
    """True when `err` is this rank learning that another rank's process went away."""
    return isinstance(err, RuntimeError) and any(text in str(err) for text in PEER_GONE)


def forget_frames(err: BaseException) -> None:
    """Drop the tracebacks of `err` and the exceptions chained to it, so the frames' locals die."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


def _rank() -> str:
    import os

    return os.environ.get("RANK", "0")


def say(line: str) -> None:
    """`line` on stderr in one write. The ranks of a launch share the stream: print writes the
    newline apart, and another rank's line could land between the two."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    import megatron_tc.calibrate.strategies  # noqa: F401  (registers every init, ablations included, before the check)
    from megatron_tc.config import ConfigError, load_config, split_cli_args
    from megatron_tc.parallel.state import leave_after_error, mark_stopping, shutdown_distributed

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path, overrides = split_cli_args(rest)
        cfg = load_config(path, overrides)
    except ConfigError as err:
        say(f"config error: {err}")
        leave_after_error()  # every rank refuses the same config: each prints its line before any exits
        return 2
    from megatron_tc.distill.runner import StoppedBySignal, run_pipeline

    force = [s.strip() for s in args.force.split(",") if s.strip()]
    try:
        run_pipeline(cfg, force=force, stop_after=args.stop_after)
    except ConfigError as err:  # checks that need the world size or the teacher
        say(f"config error: {err}")
        forget_frames(err)
        leave_after_error()
        return 2
    except user_errors() as err:  # the other ranks learn of it as a peer gone (below)
        say(f"error on rank {_rank()}: {err}")
        forget_frames(err)  # they hold the run's process groups, which leaving must close
        leave_after_error()
        return 2
    except RuntimeError as err:
        if not peer_failed(err):
            raise
        say(f"rank {_rank()}: stopped because another rank failed (its error is above)")
        mark_stopping()
        # launchers report the first rank to exit non-zero: let the failing rank, already exiting
        # when its peers learn of it, go first so its code (2 for bad input) is the job's
        time.sleep(PEER_EXIT_GRACE_S)
        return 1
    except StoppedBySignal as stop:  # the code a shell gives a process the signal ended: not finished
        say(str(stop))
        shutdown_distributed()
        return 128 + stop.signum
    shutdown_distributed()
    return 0


def process_main(argv: list[str] | None = None) -> int:
    """`main` for a process that ends when it returns (tools/distill.py).

    The garbage collector is told what lives until the process ends: the modules imported up front
    (torch among them, ~170k objects) and, when `main` returns, everything still alive (~500k with
    DeepSpeed, megatron-core and transformers loaded). Frozen objects sit outside every generation,
    so the run's full collections skip the modules, and CPython's finalization does not run its
    three full collections over the lot (`Py_FinalizeEx`: one before the modules are torn down, two
    while it clears them), which took 2-4 s of every exit. atexit handlers still run and objects
    still die by reference count; the runner has closed TensorBoard and written its checkpoints
    and manifest before `main` returns, and on the normal path `shutdown_distributed` has already
    collected the run's own cycles. Not for callers that go on running in the same process."""
    import megatron_tc.calibrate.strategies  # noqa: F401  (what `main` imports first)
    import megatron_tc.distill.runner  # noqa: F401

    gc.freeze()
    try:
        return main(argv)
    finally:
        gc.freeze()

