"""Register the exported-student classes with transformers' Auto classes, lazily.

`import megatron_tc` must stay cheap (no transformers model code, no deepspeed, no fla), yet
`AutoModelForCausalLM.from_pretrained(student_dir)` must work after it. So `install()` registers
at once when transformers' auto modules are already imported, and otherwise puts a tiny finder on
`sys.meta_path` that registers right after `transformers.models.auto.configuration_auto` or
`...modeling_auto` is first imported (i.e. the first time anyone touches an Auto class).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Callable

_TRIGGERS = ("transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto")
# Registering imports the Auto classes and PreTrainedModel: it waits until none of these is still
# being imported (a trigger can complete inside a larger import: `from transformers import
# AutoModelForCausalLM` runs configuration_auto inside modeling_auto, a model class runs both inside
# modeling_utils), else it would import a half-initialized module and fail.
_FIRE_AFTER = _TRIGGERS + ("transformers.modeling_utils",)
_done = False


def _importing(name: str) -> bool:
    """Whether module `name` is still executing its import."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _register() -> None:
    global _done
    if _done:
        return
    student = sys.modules.get("megatron_tc.convert.hf_student")
    if student is not None and not hasattr(student, "register"):
        return  # hf_student is being imported right now (it imported transformers); it registers at its end
    auto_models = sys.modules.get(_TRIGGERS[1])
    if auto_models is not None and not hasattr(auto_models, "AutoModelForCausalLM"):
        return  # modeling_auto is still being imported (it imported configuration_auto); its end fires again
    _done = True
    try:
        from megatron_tc.convert.hf_student import register

        register()
    except Exception as err:  # never break the user's import of transformers
        warnings.warn(f"megatron_tc could not register its transformers classes: {err!r}", stacklevel=2)


class _CallbackLoader(importlib.abc.Loader):
    """Runs the real loader, then the callback."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _FIRE_AFTER or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, lambda: self._fire(fullname))
        return spec

    def _fire(self, finished: str) -> None:
        if any(_importing(name) for name in _FIRE_AFTER if name != finished):
            return  # the enclosing import's own completion fires again
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _register()


def install() -> None:
    """Register now if transformers' Auto classes are loaded, else when they first are."""
    if any(name in sys.modules for name in _TRIGGERS):
        _register()
    elif not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
