"""Hugging Face classes for exported hybrid students (model_type "megatron_tc_hybrid").

The classes live in `megatron_tc.export` (self-contained modules that the export copies into the
student's directory); this module registers them with the Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` works after `import megatron_tc` as well as with
`trust_remote_code=True` where megatron_tc is not installed, and converts configs to `ArchConfig`.
"""
from __future__ import annotations

from megatron_tc.export.cache_megatron_tc import MegatronTCCache
from megatron_tc.export.configuration_megatron_tc import MODEL_TYPE, MegatronTCConfig
from megatron_tc.export.modeling_megatron_tc import MegatronTCForCausalLM, MegatronTCPreTrainedModel

__all__ = ["MODEL_TYPE", "MegatronTCCache", "MegatronTCConfig", "MegatronTCForCausalLM",
           "MegatronTCPreTrainedModel", "arch_of", "register"]


def arch_of(config: MegatronTCConfig):
    """The `ArchConfig` a student config describes."""
    from megatron_tc.model.config import ArchConfig

    if not config.arch:
        raise ValueError("MegatronTCConfig has no `arch`: build it with MegatronTCConfig.from_arch(arch)")
    return ArchConfig.from_dict(dict(config.arch))


def register() -> None:
    """Register the classes with AutoConfig / AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, MegatronTCConfig, exist_ok=True)
    AutoModelForCausalLM.register(MegatronTCConfig, MegatronTCForCausalLM, exist_ok=True)


register()  # importing this module is enough to use the Auto classes
