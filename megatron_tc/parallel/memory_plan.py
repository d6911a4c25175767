"""Bytes per GPU of a stage-2 run (student trained, teacher frozen) and its step time, before
anything is allocated: in the spirit of DeepSpeed's `estimate_zero3_model_states_mem_needs`,
for a teacher and a student together.

Parameter counts come from the model itself (built on the meta device). Per GPU, with P, Q and
T the rank's share (after TP x PP) of the student's parameters, its trainable ones and the
teacher's (bf16 training, fp32 master weights, AdamW)::

    student weights    2 P; ZeRO-3: / dp
    gathered weights   ZeRO-3: 2 min(P, 1e9), the bf16 parameters DeepSpeed keeps gathered
                       (stage3_max_live_parameters)
    gradients          2 Q; ZeRO-2/3: / dp
    grad bucket        ZeRO-1/2/3: 2 min(Q / dp, 5e8), the reduce bucket allocated up front
                       (`zero_bucket_elements`)
    optimizer          12 Q (fp32 master, Adam m and v); ZeRO-1/2/3: / dp; offloaded: 0
    teacher            2 T whole per rank ('replicated'), or 2 T / dp plus its gathered weights
                       ('engine', a ZeRO-3 inference engine)
    activations        per micro-batch token and layer, what the CUDA training path keeps for
                       backward (`layer_activation_bytes`); with checkpointing the layer inputs
                       (2 h per layer) plus one layer's intermediates
    loss buffers       6 bytes per logit of the rank's vocabulary slice: both models' bf16 logits
                       and the student's bf16 logit gradient (the chunked losses keep no fp32
                       [tokens, vocab] tensor)
    optimizer step     8 bytes per parameter of one ZeRO-3 sub-group (sub_group_size, 1e9; below
                       ZeRO-3 the whole shard): its fp32 gradient and AdamW's sqrt(v) temporary;
                       offloaded: 0

The peak is the larger of two phases, not the sum of every part: forward + backward holds the
states, the gathered weights, the activations and the loss buffers; the optimizer step holds the
states, the teacher's logits (alive until the step ends) and the step's fp32 buffers.

Step time and tokens/s: `parallel.step_model` (a measured-and-fitted model, stated there).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_tc.model.config import ArchConfig
from megatron_tc.parallel.deepspeed_engine import zero_bucket_elements
from megatron_tc.parallel.step_model import step_model

GIB = 1024**3
# DeepSpeed's defaults for what the shipped JSON leaves out: parameters ZeRO-3 keeps gathered
# (stage3_max_live_parameters) and parameters per optimizer sub-group (sub_group_size)
ZERO3_LIVE_PARAMETERS, ZERO3_SUB_GROUP = 1_000_000_000, 1_000_000_000


@dataclass(frozen=True)
class PlanInput:
    teacher: ArchConfig
    student_pattern: str  # 'A' / 'G' per layer
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 3
    offload_optimizer: bool = False
    teacher_mode: str = "replicated"  # or 'engine'
    micro_batch_size: int = 1
    seq_len: int = 2048
    activation_checkpointing: bool = False
    trainable: str = "all"  # or 'mixers', 'gdn'
    compile: str = "auto"  # stage 2's parallel.compile: auto, true or false (the step model's fixed cost)


class PlanError(ValueError):
    """A parallel layout that cannot run (e.g. tp not dividing the heads)."""


def check(plan: PlanInput) -> None:
    from megatron_tc.convert.errors import ConversionError
    from megatron_tc.convert.layout import check_tp, stage_ranges

    try:
        check_tp(plan.teacher, plan.tp)
        stage_ranges(plan.teacher, plan.pp)
    except ConversionError as err:
        raise PlanError(str(err)) from err
    if len(plan.student_pattern) != plan.teacher.num_layers or set(plan.student_pattern) - {"A", "G"}:
        raise PlanError(f"student pattern {plan.student_pattern!r} must have one 'A' or 'G' per teacher layer "
                        f"({plan.teacher.num_layers})")
    if plan.pp > 1 and plan.zero_stage > 1:
        raise PlanError(f"pp={plan.pp} with zero_stage={plan.zero_stage}: DeepSpeed's pipeline engine allows ZeRO-1 at most")
    if plan.teacher_mode not in ("replicated", "engine"):
        raise PlanError(f"teacher_mode {plan.teacher_mode!r}: use 'replicated' or 'engine'")


def parameter_counts(arch: ArchConfig, trainable: str = "all") -> dict[str, int]:
    """{'total', 'trainable', 'largest_layer'} of a HybridLM of `arch` (counted on the meta device)."""
    return dict(_counts(json.dumps(arch.to_dict(), sort_keys=True), trainable))


@functools.lru_cache(maxsize=64)
def _counts(arch_json: str, trainable: str) -> tuple[tuple[str, int], ...]:
    from megatron_tc.distill.stage2 import select_trainable
    from megatron_tc.model import HybridLM

    with torch.device("meta"):
        model = HybridLM(ArchConfig.from_dict(json.loads(arch_json)))
    names = set(select_trainable(model, trainable))
    params = dict(model.named_parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    return (("total", sum(p.numel() for p in params.values())),
            ("trainable", sum(p.numel() for n, p in params.items() if n in names)), ("largest_layer", max(layers)))


def layer_activation_bytes(arch: ArchConfig, kind: str) -> int:
    """Bytes one layer keeps for backward per token on the CUDA training path (bf16 activations,
    fla's chunked kernel, the compiled blocks of `model.fused`), its input included:

    norms (each)  input and output (bf16), 1/rms (fp32)
    attention     roped q and k, v, SDPA's output (o_proj reads it through a view) and its fp32
                  log-sum-exp per head, the cos / sin tables
    GDN           q/k/v projections before SiLU; what fla's chunk kernel saves: L2-normed q and k and
                  v at the query heads, fp32 1/norm of q and k, cumulative decay and beta, the
                  [chunk] x [chunk] block inverse A per head in bf16; the a / b projections; the
                  kernel output in fp32 for o_norm, the normed output (fp32), g_proj's output and
                  the gated output
    MLP           gate and up projections and their product (the compiled block recomputes SiLU)
    """
    h, f, d, heads = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.num_heads
    q, kv = heads * d, arch.num_kv_heads * d
    norms = 2 * (2 * 2 * h + 4)
    mlp = 2 * 3 * f
    if kind == "A":
        mixer = 2 * (2 * q + 2 * kv) + 4 * heads + 2 * 2 * d
    else:
        kvg = arch.gdn_kv_heads * d
        projections = 2 * (q + 2 * kvg) + 2 * 2 * heads  # q/k/v before SiLU, a and b
        kernel = 2 * 3 * q + 4 * 4 * heads + 2 * arch.gdn_chunk_size * heads
        output = 4 * q + 4 * q + 2 * q + 2 * q
        mixer = projections + kernel + output
    return norms + mixer + mlp


def plan_memory(plan: PlanInput) -> dict[str, Any]:
    """Bytes per GPU by part, the two phases, the peak (`total_bytes`) and the step model; see the
    module docstring."""
    check(plan)
    student = plan.teacher.with_pattern(plan.student_pattern)
    counts = parameter_counts(student, plan.trainable)
    teacher_total = parameter_counts(plan.teacher)["total"] / (plan.tp * plan.pp)
    p, q = counts["total"] / (plan.tp * plan.pp), counts["trainable"] / (plan.tp * plan.pp)
    z, dp = plan.zero_stage, plan.dp
    q_shard = q / (dp if z >= 1 else 1)
    if plan.teacher_mode == "engine":
        teacher = 2 * teacher_total / dp + 2 * min(teacher_total, ZERO3_LIVE_PARAMETERS)
    else:
        teacher = 2 * teacher_total
    tokens = plan.micro_batch_size * plan.seq_len
    vocab = student.vocab_size / plan.tp
    parts = {
        "student_weights": 2 * p / (dp if z == 3 else 1),
        "gathered_weights": 2 * min(p, ZERO3_LIVE_PARAMETERS) if z == 3 else 0.0,
        "gradients": 2 * q / (dp if z >= 2 else 1),
        "grad_bucket": 2 * zero_bucket_elements(int(q_shard)) if z >= 1 else 0.0,
        "optimizer": 0.0 if plan.offload_optimizer else 12 * q_shard,
        "teacher": teacher,
        "activations": activation_bytes(student, plan, tokens),
        "loss_buffers": tokens * vocab * (2 + 2 + 2),
        "optimizer_step": 0.0 if plan.offload_optimizer else 8 * (min(q_shard, ZERO3_SUB_GROUP) if z == 3 else q_shard),
    }
    static = sum(parts[k] for k in ("student_weights", "gradients", "grad_bucket", "optimizer", "teacher"))
    phases = {"fwd_bwd": static + parts["gathered_weights"] + parts["activations"] + parts["loss_buffers"],
              "step": static + 2 * tokens * vocab + parts["optimizer_step"]}
    total = max(phases.values())
    step = step_model(student, plan.teacher, plan)
    return {"bytes": {k: int(v) for k, v in parts.items()}, "total_bytes": int(total),
            "total_gib": round(total / GIB, 2), "peak_phase": max(phases, key=phases.get),
            **{f"{k}_phase_gib": round(v / GIB, 2) for k, v in phases.items()},
            "host_optimizer_bytes": int(12 * q_shard) if plan.offload_optimizer else 0,
            "parameters": {"student": counts["total"], "student_trainable": counts["trainable"],
                           "teacher": parameter_counts(plan.teacher)["total"]}, **step}


def activation_bytes(student: ArchConfig, plan: PlanInput, tokens: int) -> float:
    """Activations the first (largest) pipeline stage keeps at the start of backward."""
    kinds = student.layer_kinds[: -(-student.num_layers // plan.pp)]
    per_layer = [layer_activation_bytes(student, k) / plan.tp for k in kinds]
    if plan.activation_checkpointing:
        held = tokens * (2 * student.hidden_size * len(kinds) + max(per_layer))
    else:
        held = tokens * sum(per_layer)
    return held * (plan.pp if plan.pp > 1 else 1)  # 1F1B keeps up to pp micro-batches in flight on stage 0


def teacher_arch(source: str) -> ArchConfig:
    """ArchConfig from a preset name, an HF config.json (or its directory), or a megatron_tc checkpoint."""
    from megatron_tc.bench import models
    from megatron_tc.convert.hf_mapping import arch_from_hf_config

    presets = models.PRESETS
    if source in presets:
        return presets[source]()
    path = Path(source)
    if path.is_dir() and (path / "manifest.json").is_file():
        from megatron_tc.convert.checkpoint import read_info

        return read_info(path).arch
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise PlanError(f"{source}: not a preset ({', '.join(sorted(presets))}), an HF config.json or a checkpoint")
    arch = arch_from_hf_config(json.loads(config.read_text()))
    return dataclasses.replace(arch, layer_pattern="A" * arch.num_layers)

