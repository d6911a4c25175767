"""Time of one stage-2 optimizer step (student trained, teacher frozen) on H200-class GPUs, from the
shapes alone: the tokens/s of `tools/plan.py`.

Per GPU, with one micro-batch per rank::

    matmul        model FLOPs other than the GDN recurrence (student: forward, backward = 2 x
                  forward, and with activation checkpointing one more forward; teacher: forward)
                  at MATMUL_EFFICIENCY x the measured bf16 matmul peak (COMPILED_MATMUL_EFFICIENCY
                  when stage 2 compiles the decoder layers)
    GDN kernel    the chunked recurrence's FLOPs at the rate fla's chunk kernel reaches forward +
                  backward (op benchmark at 16 heads x 128, 131072 tokens)
    fixed         LAYER_MS per student layer of the stage (forward + backward; x 1.5 with
                  checkpointing, whose recompute repeats the forward): kernel launches, DeepSpeed's
                  per-module hooks and host synchronisation, independent of the batch;
                  COMPILED_LAYER_MS when stage 2 compiles the decoder layers (parallel.compile,
                  whose `auto` compiles under ZeRO-1/2 with tp = pp = 1 and no checkpointing)
    parameters    PARAMETER_MS_PER_BILLION per 10^9 parameters of the rank's (tp x pp) slice: ZeRO's gathers into
                  full tensors, the fp32 gradient copies and the AdamW step on the device
    communication ZeRO gathers and gradient reduce-scatter over dp, TP all-reduces of [tokens,
                  hidden], the teacher engine's gathers: bytes over LINK_GBPS (not overlapped)
    host optimizer with the optimizer offloaded, HOST_ADAM_PARAMS_PER_S
    pipeline      the 1F1B bubble at PP_MICRO_BATCHES micro-batches per step

The fixed cost runs on the host while the device computes, so the step takes the larger of
(matmul + GDN kernel) and the fixed cost, plus the rest. The five `Fitted` constants are fitted
together (minimax relative error, `parallel.step_fit`) to the 'fit' steps of
docs/results/step_model.json, measured on one H200: ZeRO-3 steps of SmolLM2-135M, the 1.1B
configuration and Llama-3-8B's widths with 8 layers (the eager per-layer and per-parameter costs),
the compiled ZeRO-1 step of SmolLM2-135M (the compiled per-layer cost) and that of the 1.1B
configuration, the one measured step bound by its device work (the compiled efficiency). The eager
steps are all bound by the fixed cost, which hides any eager efficiency above a bound: the fit
takes the bound, the lowest efficiency they allow, so that eager layouts bound by their device
work (the large teachers' ZeRO-3 runs, none measured) are not predicted faster than the data
shows. The model is within STATED_ERROR of every measured step, fitted or check. LINK_GBPS,
HOST_ADAM_PARAMS_PER_S and PP_MICRO_BATCHES are assumptions, not measurements: tensor and
pipeline parallelism, offload and more than two GPUs are extrapolations.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from megatron_tc.model.config import ArchConfig

if TYPE_CHECKING:
    from megatron_tc.parallel.memory_plan import PlanInput

# bf16 matmul peak measured on one H200 in the 1.1B training benchmark's process (TFLOP/s)
MEASURED_PEAK_TFLOPS = 708.0
# fitted to the measured steps (python -m megatron_tc.parallel.step_fit: largest error 2.47%); the eager
# efficiency is the lowest the eager steps allow (none is bound by its device work)
MATMUL_EFFICIENCY, COMPILED_MATMUL_EFFICIENCY = 0.724, 0.907
PARAMETER_MS_PER_BILLION, LAYER_MS, COMPILED_LAYER_MS = 63.17, 20.68, 11.52
# the largest relative error at any measured step (and, in points, of the data-parallel efficiency)
STATED_ERROR = 0.025
# fla's chunk kernel, forward + backward, 16 heads x 128 over 131072 tokens: 22.25 ms
# (docs/results/bench_h200_gdn_op_h16d128.json) for 3 x 16 x (8 x 64 x 128 + 6 x 128^2) FLOPs a token
GDN_KERNEL_TFLOPS = 46.3
# assumptions: NVLink bandwidth one GPU sustains in collectives, parameters per second a host AdamW
# step updates per GPU's share, micro-batches per pipeline step
LINK_GBPS, HOST_ADAM_PARAMS_PER_S, PP_MICRO_BATCHES = 200.0, 1e9, 8


class Fitted(NamedTuple):
    """The fitted constants, as `step_terms` takes them (the fit evaluates the terms at other values)."""
    matmul_efficiency: float
    compiled_matmul_efficiency: float
    parameter_ms_per_billion: float
    layer_ms: float
    compiled_layer_ms: float


FITTED = Fitted(MATMUL_EFFICIENCY, COMPILED_MATMUL_EFFICIENCY, PARAMETER_MS_PER_BILLION, LAYER_MS, COMPILED_LAYER_MS)


def gdn_forward_flops(arch: ArchConfig, tokens: int, context: int) -> float:
    """FLOPs of the GDN layers' chunked recurrence in one forward over `tokens` tokens."""
    from megatron_tc.bench.models import mixer_flops_per_token

    return tokens * sum(mixer_flops_per_token(arch, k, context) for k in arch.layer_kinds if k == "G")


def compiles(plan: "PlanInput") -> bool:
    """Whether stage 2 compiles the student's decoder layers under `plan` (parallel.compile's rule)."""
    if plan.compile == "auto":
        return plan.zero_stage in (1, 2) and plan.tp == 1 and plan.pp == 1 and not plan.activation_checkpointing
    return plan.compile == "true"


def step_terms(student: ArchConfig, teacher: ArchConfig, plan: "PlanInput",
               fitted: Fitted = FITTED) -> dict[str, float]:
    """Seconds of each term of one step on one GPU (see the module docstring) and the model FLOPs
    of the whole step (`flops`: 3 x student forward + teacher forward, the recompute excluded, as
    MFU counts them). Each term is linear in one of `fitted`'s constants (the matmul term in the
    inverse of the efficiency) or in none."""
    from megatron_tc.bench.models import forward_flops
    from megatron_tc.parallel.memory_plan import parameter_counts

    gpus = plan.tp * plan.pp * plan.dp
    global_tokens = plan.micro_batch_size * plan.seq_len * plan.dp
    student_fwd = forward_flops(student, global_tokens, plan.seq_len)
    passes = 4 if plan.activation_checkpointing else 3
    gdn = passes * gdn_forward_flops(student, global_tokens, plan.seq_len)
    matmul = passes * student_fwd + forward_flops(teacher, global_tokens, plan.seq_len) - gdn
    bubble = (PP_MICRO_BATCHES + plan.pp - 1) / PP_MICRO_BATCHES if plan.pp > 1 else 1.0
    efficiency = fitted.compiled_matmul_efficiency if compiles(plan) else fitted.matmul_efficiency
    stage_layers = -(-student.num_layers // plan.pp)

    counts = parameter_counts(student, plan.trainable)
    local = counts["total"] / (plan.tp * plan.pp)
    tokens = plan.micro_batch_size * plan.seq_len
    # TP: two all-reduces of [tokens, hidden] bf16 per layer forward, two backward (ring: 2 (tp-1)/tp)
    tp_bytes = 4 * stage_layers * tokens * student.hidden_size * 2 * 2 * (plan.tp - 1) / plan.tp
    zero_bytes = 0.0
    if plan.dp > 1:  # gradients reduced once; ZeRO-3 gathers the weights for forward, backward, recompute
        gathers = (passes - 1 if plan.zero_stage == 3 else 0) + 1
        zero_bytes = 2 * local * (plan.dp - 1) / plan.dp * gathers
        if plan.teacher_mode == "engine":
            zero_bytes += 2 * parameter_counts(teacher)["total"] / (plan.tp * plan.pp) * (plan.dp - 1) / plan.dp
    return {
        "matmul": matmul / gpus / (efficiency * MEASURED_PEAK_TFLOPS * 1e12) * bubble,
        "gdn_kernel": gdn / gpus / (GDN_KERNEL_TFLOPS * 1e12) * bubble,
        "fixed": stage_layers * (fitted.compiled_layer_ms if compiles(plan) else fitted.layer_ms) * 1e-3
                 * (1.5 if plan.activation_checkpointing else 1.0),
        "parameters": local / 1e9 * fitted.parameter_ms_per_billion * 1e-3,
        "communication": (tp_bytes + zero_bytes) / (LINK_GBPS * 1e9),
        "host_optimizer": counts["trainable"] / gpus / HOST_ADAM_PARAMS_PER_S if plan.offload_optimizer else 0.0,
        "flops": 3 * student_fwd + forward_flops(teacher, global_tokens, plan.seq_len),
    }


def step_seconds(terms: dict[str, float]) -> float:
    """The step: device compute and the host's fixed cost overlap; the rest adds."""
    device = terms["matmul"] + terms["gdn_kernel"]
    return max(device, terms["fixed"]) + terms["parameters"] + terms["communication"] + terms["host_optimizer"]


def step_model(student: ArchConfig, teacher: ArchConfig, plan: "PlanInput") -> dict[str, object]:
    """The plan's step fields: model TFLOP, seconds, tokens/s, the MFU that implies (against
    MEASURED_PEAK_TFLOPS) and the seconds of each term."""
    terms = step_terms(student, teacher, plan)
    seconds = step_seconds(terms)
    gpus = plan.tp * plan.pp * plan.dp
    flops = terms.pop("flops")
    return {"step_tflop": round(flops / 1e12, 1), "step_s": round(seconds, 3),
            "tokens_per_s": round(plan.micro_batch_size * plan.seq_len * plan.dp / seconds),
            "mfu": round(flops / seconds / gpus / (MEASURED_PEAK_TFLOPS * 1e12), 3),
            "step_terms_s": {k: round(v, 4) for k, v in terms.items()}}
