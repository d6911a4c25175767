"""Gradient check of the distillation step benchmark (tools/bench/train.py): the student on fla
under bf16 autocast against the PyTorch chunked backend in fp32, same weights and teacher logits;
also the chunked vocabulary losses against the reference ones and compiled model blocks against
eager ones."""
from __future__ import annotations

import math
import os
from contextlib import nullcontext

import torch

from megatron_tc.bench.common import rel_err
from megatron_tc.distill.losses import LossWeights, distill_loss
from megatron_tc.model import HybridLM


def grad_errors(test: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Errors of gradient set `test` against `ref` ({name: grad}).

    global: ||test - ref|| / ||ref|| over all parameters together (the number that says whether
    the update direction is right); per tensor: ||test_n - ref_n|| / ||ref_n||, whose maximum is
    dominated by tiny-gradient tensors (dt_bias, A_log, b_proj.bias: sums over tokens that cancel
    10-50x), so the worst tensor is also given relative to the global norm."""
    ref_norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in ref.values()))
    diffs = {n: float((test[n].double() - g.double()).norm()) for n, g in ref.items()}
    errs = {n: diffs[n] / float(g.double().norm()) for n, g in ref.items() if g.norm() > 0}
    worst = max(errs, key=errs.get)
    return {"grad_rel_err_global": math.sqrt(sum(d * d for d in diffs.values())) / ref_norm,
            "max_grad_rel_err": errs[worst], "worst_param": worst,
            "worst_param_err_vs_global_norm": diffs[worst] / ref_norm,
            "median_grad_rel_err": sorted(errs.values())[len(errs) // 2]}


def gradient_check(student: HybridLM, teacher: HybridLM, device, seq: int) -> dict:
    """fla + bf16 autocast vs the PyTorch chunked backend in fp32: loss and gradients.

    On CUDA also the PyTorch chunked backend under the same bf16 autocast ("bf16 baseline"): at
    random init bf16 alone moves every gradient by tens of percent (the loss gradient at the final
    norm is ~99% parallel to the hidden state, and RMSNorm's backward keeps only the rest), so the
    kernel is judged by fla's global error against that baseline's, not by a per-tensor maximum."""
    ids = torch.randint(0, student.arch.vocab_size, (1, seq), device=device)
    with torch.no_grad():
        t_logits = teacher(ids)
    amp = device.type == "cuda"
    runs = [("ref", "chunk", False, "reference"), ("test", "auto", amp, "reference")]
    runs += [("bf16_chunk", "chunk", True, "reference")] if amp else []
    runs += [("chunked_loss", "auto", amp, "chunked")]  # same as "test" but the chunked losses
    runs += [("eager_model", "auto", amp, "chunked")]  # same as "chunked_loss" with MEGATRON_TC_COMPILE=0
    results = {}
    for label, backend, use_amp, impl in runs:
        if label == "eager_model":
            os.environ["MEGATRON_TC_COMPILE"] = "0"
        student.set_gdn_backend(backend)
        student.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else nullcontext()
        with ctx:
            logits = student(ids)
        loss, _ = distill_loss(logits, t_logits, ids, student.arch.vocab_size, LossWeights(), impl=impl)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in student.named_parameters() if p.grad is not None}
        results[label] = (loss.detach(), grads)
        os.environ.pop("MEGATRON_TC_COMPILE", None)
    student.set_gdn_backend("auto")
    student.zero_grad(set_to_none=True)
    ref_loss, ref_grads = results["ref"]
    test_loss, test_grads = results["test"]
    out = {"loss_ref": float(ref_loss), "loss_rel_err": rel_err(test_loss, ref_loss),
           **grad_errors(test_grads, ref_grads)}
    chunked_loss, chunked_grads = results["chunked_loss"]  # chunked vs reference losses, same model run
    out.update(chunked_vs_reference_loss_rel_err=rel_err(chunked_loss, test_loss),
               chunked_vs_reference_grad_rel_err_global=grad_errors(chunked_grads, test_grads)["grad_rel_err_global"])
    eager_loss, eager_grads = results["eager_model"]  # compiled model blocks vs eager, same losses
    out.update(compiled_vs_eager_loss_rel_err=rel_err(chunked_loss, eager_loss),
               compiled_vs_eager_grad_rel_err_global=grad_errors(chunked_grads, eager_grads)["grad_rel_err_global"])
    if "bf16_chunk" in results:
        base = grad_errors(results["bf16_chunk"][1], ref_grads)
        out.update(bf16_chunk_grad_rel_err_global=base["grad_rel_err_global"],
                   bf16_chunk_median_grad_rel_err=base["median_grad_rel_err"],
                   bf16_chunk_max_grad_rel_err=base["max_grad_rel_err"],
                   global_err_vs_bf16_chunk=out["grad_rel_err_global"] / max(base["grad_rel_err_global"], 1e-30))
    return out
