"""Work-arounds for model code that trips DeepSpeed, applied to instances only (model/ unchanged).

`make_module_apply_safe(model)`: a submodule class that defines its own `apply(...)` with another
meaning (RotaryEmbedding.apply(x, cos, sin) rotates a tensor) hides `nn.Module.apply(fn)`, which
DeepSpeed calls on the whole model (ZeRO leaf-module flags) and which recurses into every child.
Such instances get a subclass whose `apply` does `nn.Module.apply` when called with one callable
and the original method otherwise. It does nothing once no class shadows `apply`.
"""
from __future__ import annotations

from torch import nn

_SAFE: dict[type, type] = {}


def _safe_class(cls: type) -> type:
    if cls not in _SAFE:
        original = cls.apply

        def apply(self, *args, **kwargs):
            if len(args) == 1 and not kwargs and callable(args[0]):
                return nn.Module.apply(self, args[0])
            return original(self, *args, **kwargs)

        _SAFE[cls] = type(cls.__name__, (cls,), {"apply": apply, "__module__": cls.__module__})
    return _SAFE[cls]


def make_module_apply_safe(model: nn.Module) -> nn.Module:
    for module in model.modules():
        cls = type(module)
        if cls.apply is not nn.Module.apply and cls not in _SAFE.values():
            module.__class__ = _safe_class(cls)
    return model
