"""Import a script of tools/ (not a package) as a module, for tests of its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """`load_script("tools/paper/grid.py")`: the file executed as a fresh module."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def distill_main(rank: int, world_size: int, argv: list[str], log: str | None = None) -> None:
    """tools/distill.py's `main` (the whole CLI after its process setup) on a `run_distributed` rank:
    a run on N gloo ranks without the launcher and N fresh interpreters. With `log`, the rank's
    stdout and stderr (its log lines, the closing table) go to the file `<log>.rank<rank>`."""
    import contextlib
    import sys

    from megatron_tc.distill.cli import main

    with contextlib.ExitStack() as stack:
        if log is not None:
            out = stack.enter_context(open(f"{log}.rank{rank}", "w"))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(out))
        code = main(argv)
    where = f"its log ends:\n{Path(f'{log}.rank{rank}').read_text()[-3000:]}" if log else "its error is above"
    assert code == 0, f"rank {rank}: tools/distill.py {' '.join(argv)} failed ({where})"


def rank_logs(log: str, world_size: int) -> str:
    """The files `distill_main(..., log=log)` wrote, rank 0 first."""
    return "".join(Path(f"{log}.rank{rank}").read_text() for rank in range(world_size))
