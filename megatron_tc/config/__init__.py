"""Typed run configuration: YAML + `key=value` overrides -> `Config`, with checks that run before
any process group exists. Importing this package imports neither torch nor deepspeed.

    from megatron_tc.config import load_config, validate_against_arch, save_config
    cfg = load_config("configs/quickstart.yaml", ["parallel.tp=2"], world_size=2)

Every key is documented in docs/configuration.md (generated from the field docs in `schema.py`).
"""
from .checks import derive_dp, resolve_config, validate_against_arch, validate_config
from .errors import ConfigError, InputError, command_line
from .loader import (
    apply_overrides,
    config_from_dict,
    config_from_yaml,
    config_to_dict,
    default_config_path,
    dump_config,
    load_config,
    save_config,
    split_cli_args,
)
from .paths import deepspeed_template_path, resolve_path, teacher_arch
from .names import STAGES, init_strategy_names, policy_names, register_init_strategy, register_policy
from .schema import (
    CalibrateConfig,
    Config,
    DataConfig,
    DistillConfig,
    EvalConfig,
    ExportConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    Stage1Config,
    Stage2Config,
)

__all__ = [
    "ConfigError", "InputError", "command_line", "Config", "RunConfig", "ModelConfig", "ParallelConfig", "DataConfig", "CalibrateConfig",
    "Stage1Config", "Stage2Config", "DistillConfig", "EvalConfig", "LoggingConfig", "ExportConfig",
    "load_config", "config_from_dict", "config_from_yaml", "config_to_dict", "dump_config", "save_config",
    "apply_overrides", "split_cli_args", "default_config_path",
    "validate_config", "validate_against_arch", "resolve_config", "derive_dp",
    "resolve_path", "teacher_arch", "deepspeed_template_path", "STAGES", "init_strategy_names", "policy_names", "register_init_strategy", "register_policy",
]
