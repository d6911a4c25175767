"""`python -m megatron_tc.config [CONFIG] [key=value ...] [--world-size N]`: load, check and print
the resolved config (exit 2 with the error otherwise), checked against the teacher's architecture
when model.teacher can be read here. `--write-docs` regenerates docs/configuration.md."""
from __future__ import annotations

import argparse
import sys

from .errors import ConfigError
from .loader import dump_config, load_config, split_cli_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_tc.config", description=__doc__)
    parser.add_argument("args", nargs="*", help="[CONFIG] [key=value ...]")
    parser.add_argument("--world-size", type=int, default=None, help="also check TP x PP x DP for this many processes")
    parser.add_argument("--write-docs", action="store_true", help="regenerate docs/configuration.md and exit")
    ns = parser.parse_args(argv)
    if ns.write_docs:
        from .docs import write_docs

        print(f"wrote {write_docs()}")
        return 0
    try:
        path, overrides = split_cli_args(ns.args)
        cfg = load_config(path, overrides, world_size=ns.world_size)
        arch = _checked_against_teacher(cfg, ns.world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # the teacher cannot be read (not a model, an unsupported architecture)
        print(f"error: model.teacher={cfg.model.teacher}: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_config(cfg))
    if arch is None:
        print(f"note: model.teacher={cfg.model.teacher or '(unset)'} cannot be read here; the checks against its "
              "architecture (TP against its heads, the layer pattern against its depth) run when the run starts",
              file=sys.stderr)
    return 0


def _checked_against_teacher(cfg, world_size: int | None):
    """The teacher's ArchConfig after `validate_against_arch` passed, or None when it cannot be read here."""
    from .checks import validate_against_arch
    from .paths import teacher_arch

    arch = teacher_arch(cfg)
    if arch is not None:
        validate_against_arch(cfg, arch, world_size)
    return arch


if __name__ == "__main__":
    sys.exit(main())
