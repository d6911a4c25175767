"""YAML with YAML-1.2 scalar rules (what engineers expect from a config file).

PyYAML implements YAML 1.1, where `yes`/`no`/`on`/`off` are booleans, `010` is octal, `1:30`
is a base-60 number, `2024-01-01` is a date and `1e-4` is a *string*. Here only
true/false are booleans, integers are decimal (or 0x/0o), `1e-4` is a float, and dates stay
strings. The dumper quotes every string that either rule set would read as something else, so
`load(dump(x)) == x` and the dumped file also reads correctly with plain PyYAML.
"""
from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"

_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
# every number needs a digit: '.', '-.', '0x_' are strings (float('.') / int('', 16) would raise)
_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F][0-9a-fA-F_]*|0o[0-7][0-7_]*)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with YAML-1.2 core-schema scalars."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(_BOOL, _BOOL_RE, list("tTfF"))
ConfigLoader.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))
ConfigLoader.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    if digits.startswith("0x"):
        return sign * int(digits[2:], 16)
    if digits.startswith("0o"):
        return sign * int(digits[2:], 8)
    return sign * int(digits, 10)


ConfigLoader.add_constructor(_INT, _construct_int)


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings the YAML-1.2 rules above would not read as strings."""


ConfigDumper.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))
ConfigDumper.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    """Lists of scalars on one line (`stages: [stats, init]`), anything nested as a block."""
    flat = all(not isinstance(item, (list, dict)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


ConfigDumper.add_representer(list, _represent_list)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, default_flow_style=False, width=100)
