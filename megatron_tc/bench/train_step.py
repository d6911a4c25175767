"""The stage-2 step the training benchmarks time (tools/bench/train.py, tools/bench/scaling.py):
teacher forward without grad, student forward/backward on the KL loss and the optimizer step,
plain PyTorch (AdamW, bf16 autocast) or a DeepSpeed ZeRO-3 engine as stage 2 builds it; and the
model FLOPs of that step."""
from __future__ import annotations

import os
import socket
from contextlib import nullcontext

import torch

from megatron_tc.bench.activation_memory import PhasePeaks
from megatron_tc.bench.models import forward_flops, matmul_params
from megatron_tc.distill.losses import LossWeights, distill_loss
from megatron_tc.model import HybridLM


def step_flops(student_arch, teacher_arch, trainable: str, batch: int, seq: int) -> dict[str, float]:
    tokens = batch * seq
    fwd = forward_flops(student_arch, tokens, seq)
    student = 3 * fwd if trainable == "all" else 2 * fwd + 2 * matmul_params(student_arch, trainable) * tokens
    teacher = forward_flops(teacher_arch, tokens, seq)
    return {"student_flops": student, "teacher_flops": teacher, "flops": student + teacher}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_context():
    """One-process torch.distributed + megatron-core groups (TP = PP = DP = 1)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    from megatron_tc.parallel.state import init_parallel

    return init_parallel(1, 1)


class Trainer:
    """The student (plain module + AdamW, or a DeepSpeed engine) and the frozen teacher."""

    def __init__(self, student: HybridLM, teacher: HybridLM, args, device: torch.device, ctx=None,
                 loss_impl: str = "chunked"):
        self.teacher, self.device, self.args, self.loss_impl = teacher, device, args, loss_impl
        self.vocab = student.arch.vocab_size
        self.weights = LossWeights(temperature=1.0)
        self.amp = device.type == "cuda"
        if ctx is not None:
            from megatron_tc.config import deepspeed_template_path
            from megatron_tc.parallel.deepspeed_engine import build_deepspeed_config, build_student_engine

            # every data-parallel rank its own micro-batch of args.batch rows (tools/bench/scaling.py);
            # the JSON stage 2 starts from (configs/deepspeed/zero3.json) unless --deepspeed-config names another
            ds = build_deepspeed_config(zero_stage=3, micro_batch_size=args.batch,
                                        global_batch_size=args.batch * ctx.dp_size, dp_size=ctx.dp_size,
                                        bf16=device.type == "cuda", lr=1e-5,
                                        base=deepspeed_template_path(1, getattr(args, "deepspeed_config", None)),
                                        trainable_numel=sum(p.numel() for p in student.parameters() if p.requires_grad))
            self.ds_config = ds
            self.engine, self.student, self.optimizer = build_student_engine(student, ds, ctx), None, None
        else:
            self.engine, self.student = None, student
            params = [p for p in student.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

    def step(self, ids: torch.Tensor, phases: PhasePeaks | None = None) -> torch.Tensor:
        """One step; `phases` (optional) records the peak memory of forward + backward and of the
        optimizer step (the teacher's logits stay alive through both, as in stage 2)."""
        if phases is not None:
            phases.start()
        with torch.no_grad():
            t_logits = self.teacher(ids)
        if self.engine is not None:
            loss, _ = distill_loss(self.engine(ids), t_logits, ids, self.vocab, self.weights, impl=self.loss_impl)
            self.engine.backward(loss)
            if phases is not None:
                phases.after_backward()
            self.engine.step()
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16) if self.amp else nullcontext():
                s_logits = self.student(ids)
            loss, _ = distill_loss(s_logits, t_logits, ids, self.vocab, self.weights, impl=self.loss_impl)
            loss.backward()
            if phases is not None:
                phases.after_backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if phases is not None:
            phases.after_step()
        return loss.detach()
