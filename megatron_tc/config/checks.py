"""Cross-field checks, run before any process group exists (no torch.distributed, no deepspeed).

`validate_config(cfg, world_size)` checks what the config alone decides; `validate_against_arch`
adds the checks that need the teacher's `ArchConfig` (head counts, layer count). Each failure is
a `ConfigError` whose message names the keys and says how to fix them; all failures found are
reported together.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from .errors import ConfigError, suggest
from .names import STAGES, init_strategy_names, policy_names
from .schema import Config, ParallelConfig
from .typecheck import build_section, section_to_dict

if TYPE_CHECKING:  # the model package may import torch; only attribute access is needed here
    from megatron_tc.model.config import ArchConfig


def derive_dp(parallel: ParallelConfig, world_size: int) -> int:
    """Data-parallel size: `parallel.dp` when set, else world_size / (tp * pp). Raises ConfigError."""
    errors = list(_world_size_errors(parallel, world_size))
    if errors:
        raise ConfigError("\n".join(errors))
    return parallel.dp or world_size // (parallel.tp * parallel.pp)


def resolve_config(cfg: Config, world_size: int) -> Config:
    """Validate for `world_size` processes and return a copy with `parallel.dp` filled in."""
    validate_config(cfg, world_size=world_size)
    out = build_section(Config, section_to_dict(cfg))
    out.parallel.dp = derive_dp(cfg.parallel, world_size)
    return out


def validate_config(
    cfg: Config,
    world_size: int | None = None,
    *,
    init_strategies: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
) -> None:
    """Every check that needs no teacher; `world_size` adds the TP x PP x DP and batch checks.

    `init_strategies` / `policies` default to the names in `megatron_tc.config.names`."""
    build_section(Config, section_to_dict(cfg))  # types and Literal choices, also for configs built in code
    errors: list[str] = []
    errors += _range_errors(cfg)
    if errors:  # later checks divide by these numbers
        raise ConfigError(_join(errors))
    errors += _parallel_errors(cfg, world_size)
    errors += _layout_errors(cfg)
    errors += _name_errors(cfg, init_strategies, policies)
    errors += _stage_errors(cfg)
    errors += _data_errors(cfg)
    if errors:
        raise ConfigError(_join(errors))


def validate_against_arch(cfg: Config, arch: "ArchConfig", world_size: int | None = None, **names) -> None:
    """`validate_config` plus the checks against the teacher's architecture: TP divides attention
    heads, KV heads, GDN heads and the MLP width; PP fits the layer count; an explicit layer
    pattern or keep list matches the teacher's layers."""
    validate_config(cfg, world_size, **names)
    errors = _tp_arch_errors(cfg, arch) + _layer_arch_errors(cfg, arch)
    if errors:
        raise ConfigError(_join(errors))


def _join(errors: list[str]) -> str:
    return errors[0] if len(errors) == 1 else "config has %d problems:\n- " % len(errors) + "\n- ".join(errors)


# ---- value ranges ------------------------------------------------------------------------------
_MIN_INT = {
    "parallel.tp": 1, "parallel.pp": 1, "parallel.dp": 0,
    "model.gdn_conv_size": 0, "model.gdn_chunk_size": 1, "model.make_vocab_size_divisible_by": 1,
    "data.seq_len": 1, "data.micro_batch_size": 1, "data.global_batch_size": 1,
    "data.calib_tokens": 0, "data.eval_tokens": 0,
    "calibrate.align_steps": 0, "calibrate.align_tokens": 0, "calibrate.stats_chunk_size": 1,
    "distill.stage1.steps": 0, "distill.stage1.warmup_steps": 0,
    "distill.stage2.steps": 0, "distill.stage2.warmup_steps": 0,
    "distill.eval_interval": 0, "distill.checkpoint_interval": 0, "distill.keep_last": 1, "distill.max_skipped": 0,
    "eval.tokens": 0, "logging.log_interval": 1,
    "pretrain.steps": 0, "pretrain.warmup_steps": 0,
}
_MIN_FLOAT = {  # key: (minimum, whether the minimum itself is allowed)
    "calibrate.lr_qkv": (0.0, False), "calibrate.lr_gates": (0.0, False),
    "distill.stage1.lr": (0.0, False), "distill.stage1.stage2_fraction": (0.0, False), "distill.stage2.lr": (0.0, False), "distill.stage2.min_lr": (0.0, True),
    "distill.stage2.weight_decay": (0.0, True), "distill.stage2.grad_clip": (0.0, True),
    "distill.stage2.temperature": (0.0, False), "distill.stage2.ce_weight": (0.0, True),
    "distill.stage2.hidden_weight": (0.0, True),
    "pretrain.init_std": (0.0, False), "pretrain.lr": (0.0, False), "pretrain.min_lr": (0.0, True),
    "pretrain.weight_decay": (0.0, True), "pretrain.grad_clip": (0.0, True),
}


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _range_errors(cfg: Config) -> list[str]:
    errors = [f"{k}={_get(cfg, k)} must be >= {lo}" for k, lo in _MIN_INT.items() if _get(cfg, k) < lo]
    for key, (lo, inclusive) in _MIN_FLOAT.items():
        value = _get(cfg, key)
        if value is None:  # optional keys: None means the component's own default
            continue
        if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
            errors.append(f"{key}={value} must be {'>=' if inclusive else '>'} {lo}")
    m = cfg.model
    if not 0.0 < m.keep_fraction <= 1.0:
        errors.append(f"model.keep_fraction={m.keep_fraction} must be in (0, 1]")
    if m.keep_count is not None and m.keep_count < 0:
        errors.append(f"model.keep_count={m.keep_count} must be >= 0 (or null to use keep_fraction)")
    if m.make_vocab_size_divisible_by != 128:
        errors.append(f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}: megatron_tc checkpoints "
                      "pad the vocabulary to a multiple of 128 x TP (Megatron-LM's default) and read it so; other "
                      "multiples are not supported: remove the key")
    s1 = cfg.distill.stage1
    if s1.stage2_fraction is not None and cfg.distill.stage2.tokens is None:
        errors.append(f"distill.stage1.stage2_fraction={s1.stage2_fraction} needs distill.stage2.tokens (the stage-2 "
                      "budget it is a fraction of); set it, or give distill.stage1.tokens instead")
    if s1.stage2_fraction is not None and s1.tokens is not None:
        errors.append("distill.stage1.tokens and distill.stage1.stage2_fraction are both set; keep one")
    for key in ("distill.stage2.tokens", "distill.stage1.tokens", "pretrain.tokens", "eval.seq_len", "eval.batch_size"):
        value = _get(cfg, key)
        if value is not None and value < 1:
            errors.append(f"{key}={value} must be >= 1 (or null)")
    if any(k <= 0 or not math.isfinite(k) for k in cfg.eval.target_ppl_factors):
        errors.append(f"eval.target_ppl_factors={cfg.eval.target_ppl_factors} must all be > 0 (e.g. [1.10, 1.25])")
    if any(n < 1 for n in cfg.distill.eval_steps):
        errors.append(f"distill.eval_steps={cfg.distill.eval_steps} must all be >= 1 (step 0 is always evaluated)")
    if any(n < 1 for n in cfg.eval.probe_lengths):
        errors.append(f"eval.probe_lengths={cfg.eval.probe_lengths} must all be >= 1")
    return errors


# ---- parallelism -------------------------------------------------------------------------------
def _world_size_errors(p: ParallelConfig, world_size: int) -> list[str]:
    if world_size < 1:
        return [f"world size {world_size} must be >= 1"]
    model_parallel = p.tp * p.pp
    if p.dp == 0:
        if world_size % model_parallel:
            return [
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {p.tp} * {p.pp} = "
                f"{model_parallel}: launch a multiple of {model_parallel} processes or change parallel.tp / parallel.pp"
            ]
        return []
    if model_parallel * p.dp != world_size:
        return [
            f"world size {world_size} != parallel.tp * parallel.pp * parallel.dp = {p.tp} * {p.pp} * {p.dp} = "
            f"{model_parallel * p.dp}: set parallel.dp=0 to derive it, or launch {model_parallel * p.dp} processes"
        ]
    return []


def compile_blocker(zero_stage: int | str, pp: int, tp: int, activation_checkpointing: bool) -> str | None:
    """Why stage 2 cannot compile the student's layers in this layout (None: it can). ZeRO-3 and
    activation checkpointing run hooks and recomputation per layer, pipeline stages are DeepSpeed's
    modules and tensor-parallel layers collectives inside the layer: none is traced here. ZeRO-1/2
    can pad every parameter to a 16-byte boundary of their flat buffer (the compiled kernels need
    it), ZeRO-0 cannot."""
    for blocked, why in ((zero_stage == 3, "parallel.zero_stage=3 (per-layer parameter gathers)"),
                         (zero_stage == 0, "parallel.zero_stage=0 (its bf16 optimizer packs parameters unaligned)"),
                         (pp > 1, f"parallel.pp={pp} (DeepSpeed's pipeline engine)"),
                         (tp > 1, f"parallel.tp={tp} (tensor-parallel layers)"),
                         (activation_checkpointing, "parallel.activation_checkpointing=true")):
        if blocked:
            return why
    return None


def teacher_compile_blocker(teacher_mode: str, pp: int, tp: int) -> str | None:
    """Why stage 2 cannot compile the teacher's layers (None: it can): a teacher engine runs ZeRO-3's
    per-layer gathers, pipeline stages and tensor-parallel layers collectives inside the layer."""
    for blocked, why in ((teacher_mode == "engine", "parallel.teacher_mode=engine (ZeRO-3 parameter gathers)"),
                         (pp > 1, f"parallel.pp={pp} (DeepSpeed's pipeline engine)"),
                         (tp > 1, f"parallel.tp={tp} (tensor-parallel layers)")):
        if blocked:
            return why
    return None


def _parallel_errors(cfg: Config, world_size: int | None) -> list[str]:
    p, d = cfg.parallel, cfg.data
    errors = []
    if p.pp > 1 and p.zero_stage != "auto" and p.zero_stage >= 2:
        errors.append(
            f"parallel.pp={p.pp} with parallel.zero_stage={p.zero_stage}: DeepSpeed's pipeline engine supports "
            "only ZeRO stage 0 or 1; set parallel.zero_stage=1, or parallel.pp=1 to keep ZeRO-"
            f"{p.zero_stage}"
        )
    if p.compile is True and (blocker := compile_blocker(p.zero_stage, p.pp, p.tp, p.activation_checkpointing)):
        errors.append(f"parallel.compile=true cannot be combined with {blocker}; set parallel.compile=auto "
                      "(compiles where it can) or false")
    if p.compile_teacher is True and (blocker := teacher_compile_blocker(p.teacher_mode, p.pp, p.tp)):
        errors.append(f"parallel.compile_teacher=true cannot be combined with {blocker}; set "
                      "parallel.compile_teacher=auto (compiles where it can) or false")
    dp = p.dp
    if world_size is not None:
        ws_errors = _world_size_errors(p, world_size)
        errors += ws_errors
        if not ws_errors:
            dp = p.dp or world_size // (p.tp * p.pp)
    if dp > 0 and d.global_batch_size % (d.micro_batch_size * dp):
        per_step = d.micro_batch_size * dp
        errors.append(
            f"data.global_batch_size={d.global_batch_size} is not a multiple of data.micro_batch_size * dp = "
            f"{d.micro_batch_size} * {dp} = {per_step}: use a global batch of "
            f"{max(per_step, d.global_batch_size // per_step * per_step)} or change the micro batch"
        )
    if p.shard_teacher is True and (p.tp == 1 or p.pp > 1):
        errors.append(
            f"parallel.shard_teacher=true splits the teacher over tensor-parallel ranks, which needs parallel.tp > 1 "
            f"and parallel.pp = 1 (got tp={p.tp}, pp={p.pp}); set parallel.shard_teacher=auto or false, or change "
            "parallel.tp / parallel.pp"
        )
    if p.pipeline_partition == "pattern" and p.pp > 1:
        stages = cfg.model.layer_pattern.split("|") if cfg.model.layer_pattern else []
        if len(stages) != p.pp or not all(stages):
            errors.append(
                f"parallel.pipeline_partition='pattern' with parallel.pp={p.pp} needs model.layer_pattern with "
                f"{p.pp} non-empty stages separated by '|' (e.g. 'AGGG|GAGG'), got {cfg.model.layer_pattern!r}; "
                "or set parallel.pipeline_partition=parameters"
            )
    return errors


def _tp_arch_errors(cfg: Config, arch: "ArchConfig") -> list[str]:
    # GDN layers have num_heads heads (q, a, b, g, A_log, dt_bias) and, for k/v, either num_heads
    # (gdn_expand_kv) or the teacher's KV heads: both are covered by the first two entries.
    tp = cfg.parallel.tp
    sizes = {
        "attention and GDN heads (num_heads)": arch.num_heads,
        "KV heads (num_kv_heads)": arch.num_kv_heads,
        "MLP width (intermediate_size)": arch.intermediate_size,
    }
    bad = [f"{count} {what}" for what, count in sizes.items() if count % tp]
    if not bad:
        return []
    common = math.gcd(*sizes.values())
    valid = [d for d in range(1, common + 1) if common % d == 0]
    return [f"parallel.tp={tp} does not divide the teacher's {', '.join(bad)}: choose parallel.tp from {valid}"]


def _layer_arch_errors(cfg: Config, arch: "ArchConfig") -> list[str]:
    m, n = cfg.model, arch.num_layers
    errors = []
    if cfg.parallel.pp > n:
        errors.append(f"parallel.pp={cfg.parallel.pp} exceeds the teacher's {n} layers: every stage needs a layer")
    kinds = m.layer_pattern.replace("|", "")
    if m.layer_pattern and len(kinds) != n:
        errors.append(
            f"model.layer_pattern has {len(kinds)} layers but the teacher has {n}: give one letter per layer "
            f"('A' keep attention, 'G' convert), e.g. {'AGGG' * (n // 4) + 'G' * (n % 4)!r}"
        )
    out_of_range = [i for i in m.keep_layers if i >= n]
    if out_of_range:
        errors.append(f"model.keep_layers {out_of_range} are out of range: the teacher has layers 0..{n - 1}")
    if m.keep_count is not None and m.keep_count > n:
        errors.append(f"model.keep_count={m.keep_count} exceeds the teacher's {n} layers")
    return errors


# ---- layout, names, stages, data ---------------------------------------------------------------
def _layout_errors(cfg: Config) -> list[str]:
    m = cfg.model
    errors = []
    bad = sorted(set(m.layer_pattern) - set("AG|"))
    if bad:
        errors.append(
            f"model.layer_pattern={m.layer_pattern!r} contains {bad}: use only 'A' (attention), 'G' (Gated DeltaNet) "
            "and '|' (pipeline-stage boundary)"
        )
    if m.layer_pattern and m.keep_layers:
        errors.append("model.layer_pattern and model.keep_layers are both set: keep one (the pattern says the same thing)")
    if any(i < 0 for i in m.keep_layers) or len(set(m.keep_layers)) != len(m.keep_layers):
        errors.append(f"model.keep_layers={m.keep_layers} must be distinct layer indices >= 0")
    return errors


def _name_errors(cfg: Config, init_strategies: Sequence[str] | None, policies: Sequence[str] | None) -> list[str]:
    inits = tuple(init_strategies) if init_strategies is not None else init_strategy_names()
    pols = tuple(policies) if policies is not None else policy_names()
    errors = []
    if cfg.calibrate.init not in inits:
        errors.append(
            f"calibrate.init={cfg.calibrate.init!r} is not a known strategy.{suggest(cfg.calibrate.init, inits)} "
            f"Known: {', '.join(inits)}"
        )
    try:
        from megatron_tc.distill.signals import signal_numbers

        signal_numbers(cfg.run.exit_signals)
    except ValueError as err:
        errors.append(f"run.exit_signals={cfg.run.exit_signals}: {err}")
    if cfg.model.policy not in pols:
        errors.append(
            f"model.policy={cfg.model.policy!r} is not a known policy.{suggest(cfg.model.policy, pols)} "
            f"Known: {', '.join(pols)}"
        )
    return errors


def _stage_errors(cfg: Config) -> list[str]:
    stages = cfg.run.stages
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        hints = "".join(suggest(s, STAGES) for s in unknown)
        return [f"run.stages has unknown stage(s) {unknown}.{hints} Stages: {', '.join(STAGES)}"]
    errors = []
    if len(set(stages)) != len(stages):
        errors.append(f"run.stages={stages} lists a stage twice: list each once")
    order = sorted(dict.fromkeys(stages), key=STAGES.index)
    if list(dict.fromkeys(stages)) != order:
        errors.append(f"run.stages={stages} is out of order: stages run in pipeline order, write {order}")
    if not stages:
        errors.append(f"run.stages is empty: name at least one of {', '.join(STAGES)}")
    # Combinations the trainers do not run: refused here, before any stage has run.
    par = cfg.parallel
    if "stage1" in stages and par.pp > 1:
        errors.append(f"run.stages has stage1 with parallel.pp={par.pp}: stage 1 runs with pp=1 "
                      "(tensor and data parallelism); run stage1 with pp=1, then stage2 with pp>1")
    return errors


def _data_errors(cfg: Config) -> list[str]:
    d, stages = cfg.data, cfg.run.stages
    src, split = d.source, d.split
    errors = []
    if d.token_store is not None and src != type(src)():
        errors.append("data.token_store and data.source are exclusive: the store holds the documents; remove the "
                      "data.source settings (or data.token_store)")
    if src.kind in ("text", "jsonl", "parquet") and not src.paths:
        errors.append(f"data.source.kind={src.kind!r} needs data.source.paths (files, directories or globs)")
    if src.kind == "hub" and not src.hub_name:
        errors.append("data.source.kind='hub' needs data.source.hub_name")
    fractions = {"calibration_fraction": split.calibration_fraction, "eval_fraction": split.eval_fraction}
    for key, value in fractions.items():
        if not 0.0 <= value < 1.0:
            errors.append(f"data.split.{key}={value} must be in [0, 1)")
    if sum(fractions.values()) >= 1.0:
        errors.append("data.split.calibration_fraction + data.split.eval_fraction must be < 1 to leave training text")
    overlap = sorted(set(split.calibration_docs) & set(split.eval_docs))
    if overlap:
        errors.append(f"documents pinned to both calibration and evaluation: {overlap[:5]}; text must never overlap")
    needs_calib = bool({"stats", "init", "stage1"} & set(stages)) or ("select" in stages and cfg.model.policy != "uniform")
    if needs_calib and not (split.calibration_docs or split.calibration_fraction > 0):
        errors.append("no calibration text: set data.split.calibration_fraction > 0 or name data.split.calibration_docs")
    periodic_eval = cfg.distill.eval_interval > 0 or bool(cfg.distill.eval_steps)
    needs_eval = "eval" in stages or (bool({"stage2", "pretrain"} & set(stages)) and periodic_eval)
    if needs_eval and not (split.eval_docs or split.eval_fraction > 0):
        errors.append("no evaluation text: set data.split.eval_fraction > 0 or name data.split.eval_docs")
    if cfg.eval.tokens > d.eval_tokens:
        errors.append(
            f"eval.tokens={cfg.eval.tokens} exceeds the data.eval_tokens={d.eval_tokens} reserved for evaluation: "
            "raise data.eval_tokens or lower eval.tokens (0 uses all)"
        )
    s2 = cfg.distill.stage2
    per_step = d.global_batch_size * d.seq_len
    if s2.tokens is not None and s2.tokens < per_step:
        errors.append(
            f"distill.stage2.tokens={s2.tokens} is less than one step (global_batch_size * seq_len = {per_step}): "
            "raise it or use distill.stage2.steps"
        )
    if s2.min_lr > s2.lr:
        errors.append(f"distill.stage2.min_lr={s2.min_lr} exceeds distill.stage2.lr={s2.lr}: the schedule decays from lr to min_lr")
    return errors + _pretrain_errors(cfg)


def _pretrain_errors(cfg: Config) -> list[str]:
    if "pretrain" not in cfg.run.stages:
        return []
    p, errors = cfg.pretrain, []
    if not p.hf_config:
        errors.append("run.stages has pretrain but pretrain.hf_config is not set: name the HF config.json of the "
                      "model to pretrain (e.g. configs/paper/teacher_qwen2.json)")
    if not cfg.data.tokenizer:
        errors.append("run.stages has pretrain but data.tokenizer is not set: the model has no teacher whose "
                      "tokenizer could be used; name an HF tokenizer directory or a .gguf file")
    if cfg.parallel.pp > 1:
        errors.append(f"run.stages has pretrain with parallel.pp={cfg.parallel.pp}: the pretrain stage runs with data "
                      "and tensor parallelism (ZeRO); set pp=1, or pretrain in its own run")
    if p.tokens is not None and p.tokens < cfg.data.global_batch_size * cfg.data.seq_len:
        errors.append(f"pretrain.tokens={p.tokens} is less than one step (global_batch_size * seq_len); raise it")
    if p.min_lr > p.lr:
        errors.append(f"pretrain.min_lr={p.min_lr} exceeds pretrain.lr={p.lr}: the schedule decays from lr to min_lr")
    return errors
