"""`python -m megatron_tc.config [CONFIG] [key=value ...] [--world-size N]`: load, check and print
the resolved config (exit 2 with the error otherwise). `--write-docs` regenerates docs/configuration.md."""
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
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_config(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
