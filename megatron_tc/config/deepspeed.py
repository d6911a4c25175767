"""Our config -> a DeepSpeed config dict (no deepspeed import: this runs before process groups).

The template is `parallel.deepspeed_config` when set, else configs/deepspeed/zero3.json (pp == 1)
or configs/deepspeed/zero1_pipeline.json (pp > 1). Keys our config owns are overwritten so the
two cannot disagree: batch sizes, gradient clipping, bf16, the ZeRO stage, the optimizer's lr and
weight decay, PyTorch AdamW on CPU, and DeepSpeed's own TensorBoard monitor.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from .checks import derive_dp, validate_config
from .errors import ConfigError
from .loader import repo_root
from .schema import Config


def deepspeed_template_path(cfg: Config) -> Path:
    if cfg.parallel.deepspeed_config:
        return Path(cfg.parallel.deepspeed_config)
    name = "zero1_pipeline.json" if cfg.parallel.pp > 1 else "zero3.json"
    return repo_root() / "configs" / "deepspeed" / name


def load_deepspeed_template(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"parallel.deepspeed_config: {path} not found") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"parallel.deepspeed_config: {path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object")
    return data


def build_deepspeed_config(
    cfg: Config,
    world_size: int,
    *,
    device: Literal["cpu", "cuda"],
    stage: Literal["stage1", "stage2"] = "stage2",
    tensorboard_dir: str | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for training `stage` with `world_size` processes on `device`."""
    validate_config(cfg, world_size=world_size)
    dp = derive_dp(cfg.parallel, world_size)
    d = cfg.data
    ds = copy.deepcopy(load_deepspeed_template(deepspeed_template_path(cfg)))
    ds["train_batch_size"] = d.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = d.micro_batch_size
    ds["gradient_accumulation_steps"] = d.global_batch_size // (d.micro_batch_size * dp)
    optim = cfg.distill.stage2 if stage == "stage2" else cfg.distill.stage1
    ds["gradient_clipping"] = cfg.distill.stage2.grad_clip
    ds.setdefault("bf16", {})["enabled"] = cfg.run.precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = False
    ds.setdefault("zero_optimization", {})["stage"] = cfg.parallel.zero_stage
    params = ds.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})
    params["lr"] = optim.lr
    params["weight_decay"] = getattr(optim, "weight_decay", 0.0)
    if device == "cpu":
        params["torch_adam"] = True  # DeepSpeed's fused/CPU Adam needs compiled ops
    if cfg.parallel.pp > 1:
        ds.setdefault("pipeline", {})["activation_checkpoint_interval"] = int(cfg.parallel.activation_checkpointing)
    if tensorboard_dir is not None:
        ds["tensorboard"] = {"enabled": True, "output_path": str(tensorboard_dir), "job_name": "deepspeed"}
    return ds
