"""ZeRO-1/2's optimizer step without its per-tensor host work (DeepSpeed 0.19, `DeepSpeedZeroOptimizer`).

Before each update DeepSpeed's ZeRO-1/2 optimizer walks every gradient tensor in Python twice:
- with bf16 (`bf16.check_grad_overflow`, on by default), an overflow scan: max, min and
  `isfinite` per tensor, about ten kernels each;
- for clipping, the global norm: one fp64 copy and one norm per tensor.
For a model of a few hundred tensors these launches, not the arithmetic, are the step: an H200
spent 90 ms in the step of the SmolLM2-135M student (426 tensors), most of it in the scan
and the norms, where the plain loop's clipping and fused AdamW took 7 ms
(docs/benchmarks.md).

On a CPU the launches cost little, but the norm's fp64 copy of every gradient (half a GiB for
the SmolLM2 student's half on each of 2 ranks) is new memory each step: about 12% of the
quickstart's stage-2 step in a py-spy profile of 2 ranks on 2 cores.

`streamline_zero_step(engine)` keeps both decisions and replaces the walks on that engine
(`deepspeed_engine.build_student_engine` applies it: stage 1, stage 2, pretraining):
- the overflow scan goes: a NaN or inf in any gradient makes the global norm NaN or inf, which
  DeepSpeed's step already treats as an overflow (it is the only check it makes for fp32 runs),
  so the step is skipped exactly when the scan would skip it;
- the global norm is computed by one `torch._foreach_norm` (CUDA; on a CPU one norm per tensor,
  accumulated in fp64 without a copy) over the same tensors, selected as
  DeepSpeed selects them (pipeline-replicated parameters skipped, tensor-parallel duplicates
  counted once) and reduced over the same groups; it equals DeepSpeed's to fp32 rounding.
One difference: a gradient whose squared entries overflow fp32 (|g| > 1.8e19) skips the
step, where the scan alone would have passed it to the clipping.
"""
from __future__ import annotations

import types
import warnings
from typing import Any

import torch

TESTED_DEEPSPEED = "0.19."  # the release whose ZeRO-1/2 step this replaces parts of (requirements.txt)


def _foreach_grad_norm(self, gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2):
    """`DeepSpeedZeroOptimizer.get_grad_norm_direct` for the 2-norm with one foreach kernel (CUDA),
    the same tensors, groups and NaN/inf masking; other norms go to DeepSpeed's own."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    selected = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if getattr(p, PIPE_REPLICATED, False) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            selected.append(g.detach())
    if not selected:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    else:
        if selected[0].device.type == "cpu":  # accumulated in fp64 without the copy the foreach norm makes
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=get_norm_dtype()) for g in selected]
        else:
            norms = torch._foreach_norm(selected, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float().to(self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.sqrt()
    mask_nan_or_inf_with_val_inplace(total, device=self.device)
    return total


def _no_overflow_scan(self, partition_gradients: bool = True) -> None:
    """The step's overflow decision is left to the global norm (module doc)."""
    self.overflow = False


def streamline_zero_step(engine: Any) -> bool:
    """Replace the per-tensor walks of `engine`'s ZeRO-1/2 optimizer step (module doc); returns
    whether it did (not for ZeRO-0/3, CPU offload, or a step that computes no global norm)."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload or not opt.compute_grad_norm:
        return False
    if not deepspeed.__version__.startswith(TESTED_DEEPSPEED):  # the step's internals change between releases
        warnings.warn(f"DeepSpeed {deepspeed.__version__}: the ZeRO-1/2 step keeps its per-tensor checks "
                      f"(megatron_tc streamlines it for DeepSpeed {TESTED_DEEPSPEED}x only)")
        return False
    opt.get_grad_norm_direct = types.MethodType(_foreach_grad_norm, opt)
    if opt.check_grad_overflow:
        opt.check_overflow = types.MethodType(_no_overflow_scan, opt)
    return True
