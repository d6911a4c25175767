"""DeepSpeed engines: the student under ZeRO (1-3) over the data-parallel group, the frozen teacher.

- `build_deepspeed_config(...)` turns our settings into a DeepSpeed JSON dict, or completes the
  user's JSON (our values fill only what it leaves out or sets to "auto").
- `build_student_engine(model, ds_config, ctx)` = `deepspeed.initialize(..., mpu=DeepSpeedMPU(ctx))`.
- `build_teacher(teacher, ds_config, mode)`: the frozen teacher either in its own DeepSpeed engine
  without optimizer (ZeRO-3 parameter partitioning for inference, the pattern TRL uses) or as a
  plain replicated copy. Either way it is in eval mode, its parameters do not require gradients,
  and `assert_no_grads` proves after a step that none arrived.
- `release_engine(engine)`: what a trainer's `close()` calls when its run ends, however it ends.

On CPU, DeepSpeed's first collective would compile its shared-memory all-reduce op (about 90 s
of C++ build per fresh cache). That op serves only `inference_all_reduce` (AutoTP inference),
which nothing here calls, so `avoid_cpu_shm_build()` marks it unavailable; training collectives go
through torch.distributed (gloo) either way.
"""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
from torch import nn

from .state import DeepSpeedMPU, ParallelContext

TeacherMode = Literal["engine", "replicated"]
_LARGE = 10**9  # "never" for DeepSpeed's print intervals


def avoid_cpu_shm_build() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op (see module doc)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.comm.comm as ds_comm
    if ds_comm.cdb is not None:  # already initialized: nothing left to avoid
        return
    # deepspeed.ops caches its compatibility probe in this dict and reads it before building.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# Notices DeepSpeed prints on every rank of every run that ask nothing of the user: its ZeRO
# all-gather calls an API torch 2.13 deprecates, and the empty leaf-module list stage 2 passes on
# purpose (distill/stage2_setup.py) is reported as matching no module.
_DEPRECATED_ALL_GATHER = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"
_EMPTY_LEAF_LIST = "ZeRO leaf module configuration did not match any modules"


def quiet_deepspeed_notices() -> None:
    """Filter the two notices above (idempotent)."""
    from deepspeed.utils import logger

    warnings.filterwarnings("ignore", message=_DEPRECATED_ALL_GATHER, category=FutureWarning)
    if not any(getattr(f, "megatron_tc", False) for f in logger.filters):
        def drop(record) -> bool:
            return not str(record.msg).startswith(_EMPTY_LEAF_LIST)
        drop.megatron_tc = True
        logger.addFilter(drop)


def init_deepspeed_comm() -> None:
    """Point deepspeed.comm at the already-initialized torch.distributed group (same backend)."""
    import deepspeed
    import torch.distributed as dist

    avoid_cpu_shm_build()
    quiet_deepspeed_notices()
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call parallel.state.init_parallel first")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)


# ---- config -------------------------------------------------------------------------------------
def _fill(target: dict, key: str, value: Any) -> None:
    """Set target[key] unless the user's JSON already gives a concrete value."""
    if target.get(key, "auto") == "auto":
        target[key] = value


def build_deepspeed_config(
    *, zero_stage: int, micro_batch_size: int, global_batch_size: int, dp_size: int,
    bf16: bool = False, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
    weight_decay: float = 0.0, grad_clip: float = 1.0, pipeline: bool = False,
    base: dict | str | Path | None = None, trainable_numel: int | None = None, device_type: str = "cuda",
) -> dict:
    """A DeepSpeed config dict for the student.

    gradient_accumulation_steps = global_batch_size / (micro_batch_size * dp_size) must be a whole
    number. bf16 on GPUs; fp32 (bf16=False) on CPU. The optimizer is AdamW from torch
    (`torch_adam`: DeepSpeed's fused CPU Adam would compile a C++ op first). `base` is the user's
    JSON (dict or path): its concrete values win, its "auto" values are filled from the run config.
    trainable_numel: elements this rank trains; sizes ZeRO's buckets (`zero_bucket_elements`, which
    also depend on `device_type`, the kind of device the ranks train on).
    """
    if pipeline and zero_stage > 1:
        raise ValueError(f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, not {zero_stage}; "
                         "set parallel.zero_stage=1 with parallel.pp > 1")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"size = {micro_batch_size} x {dp_size}; pick a global batch divisible by {per_step}")
    if isinstance(base, (str, Path)):
        base = json.loads(Path(base).read_text())
    cfg = copy.deepcopy(base) if base else {}
    _fill(cfg, "train_batch_size", global_batch_size)
    _fill(cfg, "train_micro_batch_size_per_gpu", micro_batch_size)
    _fill(cfg, "gradient_accumulation_steps", global_batch_size // per_step)
    _fill(cfg, "gradient_clipping", grad_clip)
    _fill(cfg, "steps_per_print", _LARGE)
    _fill(cfg, "wall_clock_breakdown", False)
    zero = cfg.setdefault("zero_optimization", {})
    _fill(zero, "stage", zero_stage)
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
        if key in zero:  # only where the JSON names it: DeepSpeed's own default otherwise
            _fill(zero, key, zero_bucket_elements(trainable_numel, device_type))
    bf16_cfg = cfg.setdefault("bf16", {})
    _fill(bf16_cfg, "enabled", bf16)
    if "optimizer" not in cfg:
        cfg["optimizer"] = {"type": "AdamW", "params": {}}
    params = cfg["optimizer"].setdefault("params", {})
    for key, value in (("lr", lr), ("betas", list(betas)), ("eps", eps), ("weight_decay", weight_decay),
                       ("torch_adam", True)):
        _fill(params, key, value)
    _check_batch_sizes(cfg, dp_size)
    if pipeline and zero["stage"] > 1:
        raise ValueError(f"the DeepSpeed JSON asks for ZeRO stage {zero['stage']}, but DeepSpeed's pipeline engine "
                         "supports stage 0 or 1 only; set zero_optimization.stage to 1 (or 'auto') with pp > 1")
    return cfg


# Bucket sizes (elements) of ZeRO's gradient reduce-scatter and ZeRO-3's parameter prefetch for
# "auto" in the JSON. Measured on H200s with the 1.1B benchmark model (docs/parallelism.md):
# 5e8-element buckets run the ZeRO-3 step 13-15% faster than 5e7 (483.6 vs 557.2 ms on one GPU,
# 495.8 vs 580.6 ms on two) for 0.8 GiB more memory. DeepSpeed allocates a full reduce bucket up
# front, so a model smaller than the bucket gets one of its own size instead.
ZERO_BUCKET_MAX, ZERO_BUCKET_MIN, ZERO_BUCKET_UNKNOWN = 500_000_000, 1_000_000, 50_000_000
# On CPU, ZeRO-1/2 flattens every reduce bucket into a new tensor before the all-reduce. A buffer
# over glibc's largest mmap threshold (32 MiB) is new memory each time, every page faulted in and
# zeroed again; buckets of 4e6 fp32 elements (16 MiB) are reused from the heap. The quickstart's
# stage-2 step on 2 cores (SmolLM2-135M, ZeRO-1, gloo): the gradient reduction 4.7-7.0 s -> 1.5-2.4 s
# per step with the same gradients bit for bit (docs/benchmarks.md, CPU).
ZERO_BUCKET_CPU = 4_000_000


def zero_bucket_elements(trainable_numel: int | None, device_type: str = "cuda") -> int:
    """ZeRO bucket size for a rank training `trainable_numel` elements (None: not known) on a
    `device_type` device."""
    if device_type == "cpu":
        return ZERO_BUCKET_CPU
    if trainable_numel is None:
        return ZERO_BUCKET_UNKNOWN
    return int(min(ZERO_BUCKET_MAX, max(ZERO_BUCKET_MIN, trainable_numel)))


def _check_batch_sizes(cfg: dict, dp_size: int) -> None:
    total = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp_size
    if total != cfg["train_batch_size"]:
        raise ValueError(
            f"DeepSpeed config: train_batch_size={cfg['train_batch_size']} != micro batch "
            f"{cfg['train_micro_batch_size_per_gpu']} x accumulation {cfg['gradient_accumulation_steps']} x "
            f"data-parallel {dp_size}; fix the JSON or leave these keys out (or 'auto')")


def teacher_deepspeed_config(student_config: dict) -> dict:
    """The teacher engine's config: the student's batch and precision, ZeRO-3 partitioning, no optimizer."""
    cfg = {key: copy.deepcopy(student_config[key]) for key in
           ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16")
           if key in student_config}
    cfg.update(steps_per_print=_LARGE, wall_clock_breakdown=False, zero_optimization={"stage": 3})
    return cfg


# ---- engines ------------------------------------------------------------------------------------
def build_student_engine(model: nn.Module, ds_config: dict, ctx: ParallelContext,
                         params: Iterable[nn.Parameter] | None = None, lr_scheduler: Any = None,
                         streamline: bool = True):
    """`deepspeed.initialize` the student over the DP group with TP groups from `ctx`.

    params: the trainable parameters (default: those with requires_grad). Returns the engine;
    its `.optimizer` and `.lr_scheduler` are DeepSpeed's. A ZeRO-1/2 optimizer step runs without
    its per-tensor host work and gradient copies (`parallel.zero_step.streamline_zero_step`; not
    with streamline=False, DeepSpeed's step as shipped).
    """
    import deepspeed

    init_deepspeed_comm()
    if ctx.pp_size > 1:
        raise ValueError("build_student_engine is the ZeRO path (pp == 1); use parallel.pipeline for pp > 1")
    trainable = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    if not trainable:
        raise ValueError("the student has no trainable parameters (all requires_grad=False)")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config,
                                      mpu=DeepSpeedMPU(ctx), lr_scheduler=lr_scheduler,
                                      dist_init_required=False)
    if streamline:
        from .zero_step import streamline_zero_step

        streamline_zero_step(engine)
    return engine


def release_engine(engine: Any) -> None:
    """Undo what `deepspeed.initialize` attached to the model, so the engine, its optimizer state and
    its process-group references die now rather than at interpreter exit.

    `engine.destroy()` removes ZeRO-3's per-module hooks, but three references survive it in
    DeepSpeed 0.19: the engine's own forward pre/post hooks on the module (closures over the
    engine), ZeRO-3's module-level FWD_MODULE_STACK (the top module is pushed at set-up, never
    popped), and a class-level lru_cache on PartitionedParameterCoordinator keyed by coordinator
    and submodule. Each keeps the engine alive for the life of the process, so a process running
    several stages or grid cells piles them up, and the survivors take their gloo groups down
    during interpreter finalization, which has aborted a rank ("terminate called without an
    active exception", SIGABRT). Safe on an error path (no collective); a plain module (the
    replicated teacher) is left alone.
    """
    import gc

    if not hasattr(engine, "destroy") or not hasattr(engine, "module"):
        return
    engine.destroy()
    for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        handle = getattr(engine, name, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not engine.module]
    coordinator = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", None)
    memo = getattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    # the lru_cache sits inside DeepSpeed's NVTX wrapper (a closure, no __wrapped__)
    cells = [c.cell_contents for c in (getattr(memo, "__closure__", None) or ())]
    for wrapper in [memo, *cells]:
        if hasattr(wrapper, "cache_clear"):
            wrapper.cache_clear()  # a memo of parameter ids: live engines recompute what they need
    gc.collect()


def live_engines() -> list[Any]:
    """The DeepSpeed engines this process still holds after a full garbage collection."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]


class EngineOwner:
    """A trainer holding `engine` (and `teacher`, a module or an engine): `close()`, or leaving a
    `with trainer:` block, releases both (`release_engine`); the trainer is unusable afterwards."""

    engine: Any
    teacher: Any

    def close(self) -> None:
        release_engine(self.engine)
        release_engine(self.teacher)

    def __enter__(self):
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except Exception as cleanup_error:  # noqa: BLE001
            if exc_type is None:
                raise
            # the run's own error is the one to report, not a failure while cleaning up after it
            warnings.warn(f"releasing the DeepSpeed engines after {exc_type.__name__} failed: {cleanup_error!r}")


def freeze(module: nn.Module) -> nn.Module:
    """Eval mode, no parameter requires a gradient."""
    module.eval()
    module.requires_grad_(False)
    return module


def build_teacher(teacher: nn.Module, student_config: dict, ctx: ParallelContext,
                  mode: TeacherMode = "replicated") -> nn.Module:
    """The frozen teacher: 'engine' = its own ZeRO-3 DeepSpeed engine without optimizer,
    'replicated' = the module itself on every rank. Call it under torch.no_grad()."""
    freeze(teacher)
    if mode == "replicated":
        return teacher
    if mode != "engine":
        raise ValueError(f"teacher mode {mode!r}: use 'engine' or 'replicated'")
    import deepspeed

    init_deepspeed_comm()
    engine, *_ = deepspeed.initialize(model=teacher, config=teacher_deepspeed_config(student_config),
                                      mpu=DeepSpeedMPU(ctx), dist_init_required=False)
    engine.eval()
    return engine


def assert_no_grads(teacher: nn.Module) -> None:
    """Raise if any teacher parameter requires or holds a gradient (engine or plain module)."""
    module = getattr(teacher, "module", teacher)
    bad = [name for name, p in module.named_parameters() if p.requires_grad or p.grad is not None]
    if bad:
        raise AssertionError(f"the frozen teacher has gradients or trainable parameters: {bad[:5]}")
    optimizer = getattr(teacher, "optimizer", None)
    if optimizer is not None and isinstance(optimizer, torch.optim.Optimizer):
        raise AssertionError(f"the teacher engine has an optimizer ({type(optimizer).__name__})")
