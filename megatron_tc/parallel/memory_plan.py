"""Bytes per GPU of a stage-2 run (student trained, teacher frozen) and its step time, before
anything is allocated: in the spirit of DeepSpeed's `estimate_zero3_model_states_mem_needs`,
for a teacher and a student together.

Parameter counts come from the model itself (built on the meta device). Per GPU, with P the
student's parameters and Q its trainable ones (bf16 training, fp32 master weights, AdamW)::

    student weights   2 P / (tp pp)            ZeRO-3: / dp, plus the gathered working set
                                                (two layers' bf16 weights: the one computing
                                                and the one prefetched)
    gradients         2 Q / (tp pp)            ZeRO-2/3: / dp
    optimizer         12 Q / (tp pp)           fp32 master + Adam m and v; ZeRO-1/2/3: / dp;
                                                offload: 0 on the GPU (host memory instead)
    teacher           2 Q_t / (tp pp)          'engine' (ZeRO-3 inference engine): / dp, plus
                                                its working set; 'replicated': whole per rank
    activations       per micro-batch token and layer (bf16): attention or GDN mixer + MLP
                                                intermediates (`layer_activation_bytes`); with
                                                checkpointing only the layer input (2 h) is kept
                                                per layer, plus one layer's intermediates
    loss buffers      logits of both models over the rank's vocabulary slice: teacher bf16,
                                                student fp32 and its gradient (4 + 4 + 2 bytes)

Step time: model FLOPs (`megatron_tc.bench.models`: 3 x student forward + teacher forward)
divided by a sustained rate, the measured stage-2 MFU times the device's measured matmul peak
(docs/benchmarks.md); scaling over ranks is taken as ideal, which the measured 2-GPU runs
(75-97% efficiency) bound from above.
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

GIB = 1024**3
# stage-2 step on one H200, 1.1B teacher -> quarter-attention hybrid, ZeRO-3, chunked losses
# (docs/benchmarks.md, section "Training"): 54.5% of the measured 708 TFLOP/s bf16 matmul peak
MEASURED_MFU, MEASURED_PEAK_TFLOPS = 0.545, 708.0
# assumptions of the step model (not measured here): NVLink bandwidth one GPU sustains in
# collectives, parameters per second a host AdamW step updates per GPU's share, micro-batches per
# pipeline step
LINK_GBPS, HOST_ADAM_PARAMS_PER_S, PP_MICRO_BATCHES = 200.0, 1e9, 8


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
    """bf16 bytes one layer keeps for backward, per token: norms' inputs and outputs, the
    mixer's projections and outputs, the MLP's gate, up, activation and product."""
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    if kind == "A":
        mixer = 2 * h + q + 2 * kv + q + kv + q  # norm in/out, q/k/v, roped q/k, attention output
    else:
        kvg = arch.gdn_kv_heads * d
        mixer = 2 * h + 2 * (q + 2 * kvg) + 2 * q + 4 * q  # norm in/out, q/k/v before and after SiLU, normed q/k, g, o, o_norm, gated
    mlp = 2 * h + 4 * f
    return 2 * (mixer + mlp)


def plan_memory(plan: PlanInput) -> dict[str, Any]:
    """Bytes per GPU by part, the total and the step model; see the module docstring."""
    check(plan)
    student = plan.teacher.with_pattern(plan.student_pattern)
    counts = parameter_counts(student, plan.trainable)
    teacher_counts = parameter_counts(plan.teacher)
    model_split = plan.tp * plan.pp
    z = plan.zero_stage
    p, q = counts["total"] / model_split, counts["trainable"] / model_split
    weights = 2 * p / (plan.dp if z == 3 else 1) + (4 * counts["largest_layer"] / plan.tp if z == 3 else 0)
    grads = 2 * q / (plan.dp if z >= 2 else 1)
    optimizer = 0.0 if plan.offload_optimizer else 12 * q / (plan.dp if z >= 1 else 1)
    t = teacher_counts["total"] / model_split
    if plan.teacher_mode == "engine":
        teacher = 2 * t / plan.dp + 4 * teacher_counts["largest_layer"] / plan.tp
    else:
        teacher = 2 * t
    tokens = plan.micro_batch_size * plan.seq_len
    kinds = student.layer_kinds[: -(-student.num_layers // plan.pp)]  # the first (largest) stage
    per_layer = [layer_activation_bytes(student, k) / plan.tp for k in kinds]
    if plan.activation_checkpointing:
        activations = tokens * (2 * student.hidden_size * len(kinds) + max(per_layer))
    else:
        activations = tokens * sum(per_layer)
    activations *= plan.pp if plan.pp > 1 else 1  # 1F1B keeps up to pp micro-batches in flight on stage 0
    vocab = student.vocab_size / plan.tp
    loss = tokens * vocab * (2 + 4 + 4)
    parts = {"student_weights": weights, "gradients": grads, "optimizer": optimizer, "teacher": teacher,
             "activations": activations, "loss_buffers": loss}
    total = sum(parts.values())
    step = step_model(student, plan.teacher, plan, tokens * plan.dp)
    return {"bytes": {k: int(v) for k, v in parts.items()}, "total_bytes": int(total),
            "total_gib": round(total / GIB, 2), "host_optimizer_bytes": int(12 * q / plan.dp) if plan.offload_optimizer else 0,
            "parameters": {"student": counts["total"], "student_trainable": counts["trainable"],
                           "teacher": teacher_counts["total"]}, **step}


def step_model(student: ArchConfig, teacher: ArchConfig, plan: PlanInput, global_tokens: int,
               mfu: float = MEASURED_MFU, peak_tflops: float = MEASURED_PEAK_TFLOPS) -> dict[str, float]:
    """Model FLOPs of one optimizer step (one micro-batch per rank) and its time: compute at the
    measured sustained rate, plus communication and host work that are assumed not to overlap
    (bandwidths `LINK_GBPS` inside a node, `HOST_ADAM_PARAMS_PER_S` for an offloaded optimizer),
    and the pipeline bubble with `PP_MICRO_BATCHES` micro-batches per step. Only the compute
    rate is measured; the other terms rank layouts and are not validated."""
    from megatron_tc.bench.models import forward_flops

    flops = 3 * forward_flops(student, global_tokens, plan.seq_len) + forward_flops(teacher, global_tokens, plan.seq_len)
    if plan.activation_checkpointing:
        flops += forward_flops(student, global_tokens, plan.seq_len)  # the recompute
    gpus = plan.tp * plan.pp * plan.dp
    compute = flops / (gpus * mfu * peak_tflops * 1e12)
    if plan.pp > 1:
        compute *= (PP_MICRO_BATCHES + plan.pp - 1) / PP_MICRO_BATCHES
    tokens = plan.micro_batch_size * plan.seq_len
    link = LINK_GBPS * 1e9
    # TP: two all-reduces of [tokens, hidden] bf16 per layer forward, two backward (ring: 2 (tp-1)/tp)
    tp_bytes = 4 * student.num_layers / plan.pp * tokens * student.hidden_size * 2 * 2 * (plan.tp - 1) / plan.tp
    counts = parameter_counts(student, plan.trainable)
    shard = counts["total"] / (plan.tp * plan.pp)
    zero_bytes = 0.0
    if plan.dp > 1:  # gradients reduced once; ZeRO-3 gathers the weights for forward and backward
        zero_bytes = 2 * shard * (plan.dp - 1) / plan.dp * (3 if plan.zero_stage == 3 else 1)
        if plan.teacher_mode == "engine":
            zero_bytes += 2 * parameter_counts(teacher)["total"] / (plan.tp * plan.pp) * (plan.dp - 1) / plan.dp
    host = counts["trainable"] / gpus / HOST_ADAM_PARAMS_PER_S if plan.offload_optimizer else 0.0
    seconds = compute + (tp_bytes + zero_bytes) / link + host
    return {"step_tflop": round(flops / 1e12, 1), "step_s": round(seconds, 3),
            "tokens_per_s": round(global_tokens / seconds), "assumed_mfu": mfu, "assumed_peak_tflops": peak_tflops}


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

