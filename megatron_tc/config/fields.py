"""Field helpers for the config dataclasses: one line declares a key, its default and its doc.

Every key of the run config is declared with `opt` (a value) or `section` (a nested dataclass).
The doc string lives in the field's metadata; docs/configuration.md is generated from it, and a test
fails when a field has no doc or the generated file is stale.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

DOC = "doc"
REQUIRED = "required"


def opt(default: Any, doc: str, *, required: bool = False) -> Any:
    """A config key with a default value and a one-line description.

    Mutable defaults (lists, dicts) are copied per instance. `required=True` marks a key whose
    default (None) must be replaced by the user; the loader reports it as missing otherwise.
    """
    meta = {DOC: doc, REQUIRED: required}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    """A nested section (a dataclass whose every field has a default)."""
    return dataclasses.field(default_factory=cls, metadata={DOC: doc, REQUIRED: False})


def field_doc(f: dataclasses.Field) -> str:
    return str(f.metadata.get(DOC, ""))


def is_required(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(REQUIRED, False))
