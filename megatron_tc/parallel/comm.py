"""Collectives on tensors that live wherever the caller keeps them.

NCCL only moves CUDA tensors; gloo moves CPU tensors (and CUDA ones through a host copy). Sums of
statistics, losses for logging and evaluation scores are kept on the CPU in fp64 while the default
process group is NCCL, so every collective on them goes through these helpers: the tensor travels
to a device the group's backend serves (the current CUDA device for NCCL), and the result comes
back into the caller's tensor, on the caller's device.

    all_reduce_(sums, group=dp_group)            # in place, any device
    parts = all_gather(local, group=tp_group)    # list of world-size tensors on local's device
    broadcast_(tensor, src=0, group=group)       # src: global rank, as torch.distributed
    if all_ranks(ok, group=group): ...           # the same answer on every rank
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def backend_device_types(config: str) -> set[str]:
    """Device types a backend config serves: 'cuda:nccl' -> {'cuda'}; 'cpu:gloo,cuda:gloo' ->
    {'cpu', 'cuda'}; a bare backend name (older torch) maps nccl to cuda and the rest to cpu."""
    config = str(config)
    if ":" not in config:
        return {"cuda"} if config == "nccl" else {"cpu"}
    return {part.split(":", 1)[0].strip() for part in config.split(",") if part.strip()}


def comm_device(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.device:
    """Where `tensor` must be for a collective over `group`: its own device when the group's
    backend serves it, else the current CUDA device (NCCL) or the CPU (gloo)."""
    return device_for(tensor.device, dist.get_backend_config(group))


def device_for(device: torch.device, backend_config: str) -> torch.device:
    """comm_device's rule for a tensor on `device` and a group with `backend_config`."""
    types = backend_device_types(backend_config)
    if device.type in types:
        return device
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in types:
        return torch.device("cpu")
    raise RuntimeError(f"the process group's backend ({backend_config}) serves no device this process can use "
                       f"for a {device.type} tensor (no CUDA device is visible); use parallel.backend=gloo on a "
                       "machine without CUDA")


def _in_place(tensor: torch.Tensor, group: ProcessGroup | None, collective) -> torch.Tensor:
    """Run `collective(t)` (in place) on `tensor`, or on a contiguous copy on the group's device
    whose result is copied back; returns `tensor`."""
    device = comm_device(tensor, group)
    if device == tensor.device and tensor.is_contiguous():
        collective(tensor)
        return tensor
    moved = tensor.to(device, copy=True).contiguous()
    collective(moved)
    tensor.copy_(moved)
    return tensor


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                group: ProcessGroup | None = None) -> torch.Tensor:
    """dist.all_reduce in place on a tensor of any device; returns `tensor`."""
    return _in_place(tensor, group, lambda t: dist.all_reduce(t, op=op, group=group))


def all_ranks(flag: bool, group: ProcessGroup | None = None) -> bool:
    """Whether `flag` holds on every rank of `group` (default: the world), the same answer on every
    rank: one all-reduce(MIN), none without a process group or with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    return bool(all_reduce_(torch.tensor([int(flag)]), op=dist.ReduceOp.MIN, group=group).item())


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group rank order, on `tensor`'s device."""
    device = comm_device(tensor, group)
    local = tensor.to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.to(tensor.device) for p in parts]


def broadcast_(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """dist.broadcast in place (src: a global rank) on a tensor of any device; returns `tensor`."""
    return _in_place(tensor, group, lambda t: dist.broadcast(t, src=src, group=group))


__all__ = ["all_gather", "all_ranks", "all_reduce_", "backend_device_types", "broadcast_", "comm_device", "device_for"]
