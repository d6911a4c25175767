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


def distill_main(rank: int, world_size: int, argv: list[str]) -> None:
    """tools/distill.py's `main` (the whole CLI after its process setup) on a `run_distributed` rank:
    a run on N gloo ranks without the launcher and N fresh interpreters."""
    from megatron_tc.distill.cli import main

    assert main(argv) == 0, f"rank {rank}: tools/distill.py {' '.join(argv)} failed (its error is above)"
