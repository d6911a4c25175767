"""How much device memory one rank of a distillation step needs, and the ZeRO stage that follows.

ZeRO-3 partitions the parameters themselves, so every layer's weights are gathered before its
forward and backward and released after: a collective and a set of hooks per layer and step. On a
model that fits the device, that host work is most of the step (a 135M student: 4% MFU under
ZeRO-3 against 30% without it). `choose_zero_stage` therefore picks the smallest stage whose
estimate fits: ZeRO-1 (optimizer states partitioned), else ZeRO-2 (gradients too), ZeRO-3 only
when nothing less fits. On CPU ranks (gloo) ZeRO-0 comes first: nothing is compiled there, and
under ZeRO-1's partitioned step the quickstart's stage 2 on 2 cores takes 1.13x as long as under
ZeRO-0's plain all-reduce (docs/parallelism.md). On GPUs ZeRO-1 stays the first: DeepSpeed's
ZeRO-0 bf16 optimizer packs parameters unaligned, which keeps the decoder layers from compiling.

The estimate, per rank, in bytes (N = student elements, N_t = trainable, M = teacher, dp = ranks
sharing the partitions):

  student weights       N  x w            w = 2 (bf16) or 4 (fp32); / dp under ZeRO-3
  gradients             N_t x 4           fp32 accumulation;        / dp under ZeRO-2 and 3
  optimizer             N_t x (8 + m)     AdamW moments + fp32 master copy (m = 4 under bf16, else 0);
                                          / dp under ZeRO-1, 2 and 3
  teacher weights       M  x w            / dp when the teacher has its own ZeRO-3 engine
  activations           t x L x h x a     t tokens of the micro-batch, L layers, hidden h: a = 34 bytes
                                          at bf16 (Megatron-LM's per-layer count without the score
                                          matrix: flash / chunked kernels), 68 at fp32; a layer's
                                          input only (2 h or 4 h) with activation checkpointing
  logits                t x V x 3 w       teacher and student logits and the student's logit gradient

and it fits when the total is at most `headroom` (0.85) of the device: the rest is the allocator's
fragmentation, kernel workspaces and the communication buffers.

Every rank must come to the same choice (a ZeRO stage, a split teacher), so the auto choices read
`least_device_memory`: the smallest device of the job, agreed by one all-reduce (a job may mix GPU
models, or CPU hosts of different RAM).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ZERO_STAGES = (1, 2, 3)       # what `choose_zero_stage` tries on GPUs, in order
CPU_ZERO_STAGES = (0, 1, 2, 3)  # on CPU ranks
HEADROOM = 0.85
_GiB = 2**30


@dataclass(frozen=True)
class StepFootprint:
    """What one rank of a distillation step holds (element counts; `arch` fields for activations)."""

    student_params: int
    trainable_params: int
    teacher_params: int = 0
    tokens: int = 0                   # tokens of one micro-batch on this rank
    num_layers: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    bf16: bool = False
    activation_checkpointing: bool = False
    teacher_partitioned: bool = False  # the teacher in its own ZeRO-3 engine (parallel.teacher_mode=engine)

    def bytes_per_rank(self, zero_stage: int, dp: int) -> dict[str, int]:
        """The estimate of the module doc under `zero_stage` over `dp` ranks, by part and in total."""
        w = 2 if self.bf16 else 4
        parts = {
            "student": self.student_params * w // (dp if zero_stage >= 3 else 1),
            "gradients": self.trainable_params * 4 // (dp if zero_stage >= 2 else 1),
            "optimizer": self.trainable_params * (8 + (4 if self.bf16 else 0)) // (dp if zero_stage >= 1 else 1),
            "teacher": self.teacher_params * w // (dp if self.teacher_partitioned else 1),
            "activations": self.tokens * self.num_layers * self.hidden_size * self._activation_bytes(),
            "logits": self.tokens * self.vocab_size * 3 * w,
        }
        parts["total"] = sum(parts.values())
        return parts

    def _activation_bytes(self) -> int:
        per = 2 if self.activation_checkpointing else 34
        return per if self.bf16 else 2 * per


@dataclass(frozen=True)
class ZeroChoice:
    stage: int
    fits: bool                # False: even ZeRO-3 exceeds the estimate (chosen anyway: the most it can do)
    estimate: dict[str, int]  # bytes per rank under `stage`
    device_bytes: int

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in self.estimate.items() if k != "total")
        verdict = "fits" if self.fits else "does NOT fit even partitioned; expect out-of-memory"
        return (f"ZeRO-{self.stage}: estimated {_size(self.estimate['total'])} per rank of "
                f"{_size(self.device_bytes)} ({parts}), {verdict}")


def _size(nbytes: int) -> str:
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB // 10 else f"{nbytes / 2**20:.1f} MiB"


def choose_zero_stage(footprint: StepFootprint, dp: int, device_bytes: int, headroom: float = HEADROOM,
                      stages: tuple[int, ...] = ZERO_STAGES) -> ZeroChoice:
    """The smallest ZeRO stage of `stages` (1, 2, 3; on CPU ranks `CPU_ZERO_STAGES`) whose estimate is
    at most headroom x device_bytes. When none fits, the smallest stage with the least memory (3 over
    several ranks; the first over one rank, where partitioning saves nothing and ZeRO-3 would only
    add its gathers)."""
    if dp < 1 or device_bytes <= 0:
        raise ValueError(f"choose_zero_stage: dp={dp} and device_bytes={device_bytes} must be positive")
    estimates = {stage: footprint.bytes_per_rank(stage, dp) for stage in stages}
    for stage, estimate in estimates.items():
        if estimate["total"] <= headroom * device_bytes:
            return ZeroChoice(stage, True, estimate, device_bytes)
    least = min(stages, key=lambda stage: (estimates[stage]["total"], stage))
    return ZeroChoice(least, False, estimates[least], device_bytes)


def device_memory_bytes(device: torch.device) -> int:
    """Memory one rank may use: the GPU's total, or on CPU the machine's RAM shared by the ranks on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # torchrun and Slurm (launch/distill.sh) set LOCAL_WORLD_SIZE; DeepSpeed's launcher LOCAL_SIZE
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    return ram // max(1, int(local))


_AGREED: dict[tuple[str, int, int], int] = {}


def least_device_memory(device: torch.device) -> int:
    """`device_memory_bytes` of the job's smallest device, the same on every rank. The first call
    for a device is a collective (every rank calls it at the same point); later calls are cached."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return device_memory_bytes(device)
    key = (str(device), dist.get_world_size(), dist.get_rank())
    if key not in _AGREED:
        from .comm import all_reduce_

        least = torch.tensor([device_memory_bytes(device)], dtype=torch.int64)
        _AGREED[key] = int(all_reduce_(least, op=dist.ReduceOp.MIN).item())
    return _AGREED[key]


def numel(module: Any, trainable_only: bool = False) -> int:
    if module is None:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def footprint_of(student: torch.nn.Module, teacher: torch.nn.Module | None, *, tokens: int, bf16: bool,
                 activation_checkpointing: bool = False, teacher_partitioned: bool = False) -> StepFootprint:
    """The footprint of training `student` (its requires_grad parameters) against `teacher`.
    Activations and logits come from `student.arch` when it has one (a HybridLM), else count 0."""
    arch = getattr(student, "arch", None)
    return StepFootprint(
        student_params=numel(student), trainable_params=numel(student, trainable_only=True),
        teacher_params=numel(teacher), tokens=tokens, num_layers=getattr(arch, "num_layers", 0),
        hidden_size=getattr(arch, "hidden_size", 0), vocab_size=getattr(arch, "padded_vocab_size", 0),
        bf16=bf16, activation_checkpointing=activation_checkpointing, teacher_partitioned=teacher_partitioned)
