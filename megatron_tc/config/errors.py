"""The one exception every config problem raises."""
from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A config that cannot run: the message names the key, what is wrong and how to fix it."""


def suggest(word: str, choices: Iterable[str], n: int = 3) -> str:
    """' Did you mean: a, b?' for the closest choices, or '' when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)
    return f" Did you mean: {', '.join(close)}?" if close else ""
