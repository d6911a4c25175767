"""YAML file + `key=value` overrides -> a checked `Config`; and back to YAML.

    cfg = load_config("configs/quickstart.yaml", ["parallel.tp=2", "distill.stage2.lr=1e-4",
                                                  "run.stages=[stats,init]"])
    save_config(cfg, cfg.run.run_dir)        # <run_dir>/config.yaml, the resolved config

Override values follow the same YAML scalar rules as the file (`1e-4` is a float, `[a,b]` a list,
`null` is None); a value given to a string key is taken verbatim when it does not parse as one.
A config file may name a `base:` file (relative to itself) whose values it overrides.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from .errors import ConfigError
from .schema import Config
from .typecheck import build_section, coerce, missing_required, section_to_dict, section_types
from .yamlio import dump_yaml, parse_yaml

BASE_KEY = "base"
CONFIG_FILE_NAME = "config.yaml"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_config_path() -> Path:
    """configs/quickstart.yaml: what `launch/distill.sh` runs with no argument."""
    return repo_root() / "configs" / "quickstart.yaml"


# ---- mappings ----------------------------------------------------------------------------------
def _read_mapping(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The YAML mapping in `path`, with its `base:` chain merged underneath."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path}: 'base' files form a cycle: {' -> '.join(map(str, seen + (path,)))}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass an existing YAML file (see configs/)") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (run:, model:, ...), got {type(data).__name__}")
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file {path}: 'base' must be a file path, got {base!r}")
    return deep_merge(_read_mapping(path.parent / base, seen + (path,)), data)


def deep_merge(base: dict, top: dict) -> dict:
    """`top` over `base`; nested mappings are merged key by key, everything else replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# ---- overrides ---------------------------------------------------------------------------------
def _annotation_at(parts: Sequence[str]) -> Any:
    """The annotation of a dotted key, or None when the path is not a field (reported later)."""
    cls: Any = Config
    tp: Any = None
    for part in parts:
        hints = section_types(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        tp = hints[part]
        cls = tp
    return tp


def _override_value(parts: Sequence[str], raw: str) -> Any:
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {'.'.join(parts)}={raw}: the value is not valid YAML ({err})") from None
    tp = _annotation_at(parts)
    if tp is not None and not isinstance(value, str):
        try:
            coerce(value, tp, ".".join(parts))
        except ConfigError:
            try:  # a string key given `123` or `yes`: keep the text the user typed
                return coerce(raw, tp, ".".join(parts))
            except ConfigError:
                pass
    return value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Set dotted `key=value` overrides in a nested mapping (a copy is returned)."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (for example parallel.tp=2 or run.stages=[stats,init])")
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override {item!r}: empty name in the dotted key {key!r}")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
            node = child
        value = _override_value(parts, raw)
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            value = deep_merge(node[parts[-1]], value)
        node[parts[-1]] = value
    return out


# ---- Config <-> mapping / YAML -----------------------------------------------------------------
def config_from_dict(data: dict, *, require: bool = True) -> Config:
    """Build a Config from a nested mapping; unknown keys, wrong types (and missing values) raise."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    cfg = build_section(Config, data)
    if require:
        check_required(cfg)
    return cfg


def check_required(cfg: Config) -> None:
    missing = missing_required(cfg)
    if missing:
        lines = [f"  {key}: {doc}" for key, doc in missing]
        example = " ".join(f"{key}=..." for key, _ in missing)
        raise ConfigError(
            "missing required value(s):\n" + "\n".join(lines)
            + f"\nSet them in the config file or on the command line ({example})."
        )


def config_to_dict(cfg: Config) -> dict:
    return section_to_dict(cfg)


def config_from_yaml(text: str, overrides: Iterable[str] = (), *, require: bool = True) -> Config:
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config text is not valid YAML: {err}") from None
    return config_from_dict(apply_overrides(data or {}, overrides), require=require)


def dump_config(cfg: Config) -> str:
    """The full config as YAML (every key, defaults included); `config_from_yaml(dump_config(c)) == c`."""
    return dump_yaml(config_to_dict(cfg))


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    *,
    world_size: int | None = None,
    check: bool = True,
) -> Config:
    """Load a YAML config (default: configs/quickstart.yaml), apply overrides, type-check it and,
    with `check`, run the cross-field checks that need no teacher (`validate_config`)."""
    data = _read_mapping(Path(path) if path is not None else default_config_path())
    cfg = config_from_dict(apply_overrides(data, overrides))
    if check:
        from .checks import validate_config

        validate_config(cfg, world_size=world_size)
    return cfg


def split_cli_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]` -> (config path or None, overrides)."""
    path, overrides = None, []
    for arg in argv:
        if "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give one config file, then key=value overrides")
    return path, overrides


def save_config(cfg: Config, run_dir: str | os.PathLike, name: str = CONFIG_FILE_NAME) -> Path:
    """Write the resolved config to `<run_dir>/config.yaml` atomically (temp file, then rename)."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(dump_config(cfg))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
