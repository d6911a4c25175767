"""Errors of user input: `ConfigError` for a run configuration, `InputError` for a command-line
tool's arguments and files.

Exit statuses of every tool: 0 done, 2 bad input (argparse's usage errors, a config error, an
`InputError`), 1 a failure of the work itself; a tool that can end with work left for a later run
documents its own status for that (tools/run_grid.py: 3)."""
from __future__ import annotations

import difflib
import functools
import sys
from typing import Callable, Iterable, TypeVar


class ConfigError(ValueError):
    """A config that cannot run: the message names the key, what is wrong and how to fix it."""


class InputError(SystemExit):
    """Bad input to a command-line tool: `message` is the one line a user reads (`error: ...`,
    naming the flag or file and what to give instead) and the exit status is 2. Raise it inside a
    main wrapped by `command_line`, which writes the line to stderr; `str()` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


Main = TypeVar("Main", bound=Callable[..., int])


def command_line(main: Main) -> Main:
    """`main` writing an `InputError`'s line to stderr before the error ends the process with
    status 2 (Python's exit on a SystemExit with a number prints nothing)."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except InputError as err:
            print(err.message, file=sys.stderr, flush=True)
            raise

    return run  # type: ignore[return-value]


def suggest(word: str, choices: Iterable[str], n: int = 3) -> str:
    """' Did you mean: a, b?' for the closest choices, or '' when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)
    return f" Did you mean: {', '.join(close)}?" if close else ""
