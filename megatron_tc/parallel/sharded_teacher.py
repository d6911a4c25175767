"""A teacher split over the tensor-parallel ranks from the moment it is read.

`load_tensor_parallel(path, ctx)` builds the teacher as `apply_tensor_parallel` would shard it,
but never holds the whole model: the skeleton is built on the meta device, sharded there (no
storage), then filled with each rank's slice of the checkpoint (`convert.load_slices` reads only
the byte ranges of that slice, from a checkpoint of any TP x PP layout, straight into the
teacher's dtype). Peak host memory per rank is its 1/TP of the weights plus the largest piece
read at once; every rank of a TP group ends with the same model `apply_tensor_parallel` makes
from the whole teacher.

`full_mixer(model, index, tp_group)` gathers one attention layer back into a single-device module
(closed-form initializations and readout sums work on whole layers): one layer's weights, never
the model's.

`resolve_shard_teacher(cfg, arch, device)` turns `parallel.shard_teacher` (auto | true | false)
into a decision, the same on every rank.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.model import Attention, HybridLM
from megatron_tc.model.config import ArchConfig

from .comm import all_gather
from .state import ParallelContext
from .tensor_parallel import TensorParallelHybridLM, apply_tensor_parallel, is_tensor_parallel

# The teacher runs in fp32 for the statistics pass; shard it when its fp32 weights would take more
# than this share of one device (the rest holds activations, the student and its optimizer).
AUTO_SHARE = 0.5


def teacher_fp32_bytes(arch: ArchConfig) -> int:
    """Bytes of the teacher's weights in fp32 (a model on the meta device: no memory used)."""
    with torch.device("meta"):
        model = HybridLM(arch)
    return 4 * sum(p.numel() for p in model.parameters())


def resolve_shard_teacher(cfg: Any, arch: ArchConfig, device: torch.device) -> bool:
    """parallel.shard_teacher: 'true' / 'false' as given; 'auto' shards when parallel.tp > 1,
    parallel.pp == 1 and the fp32 teacher exceeds AUTO_SHARE of the job's smallest device
    (`memory.least_device_memory`: every rank decides alike)."""
    setting, tp, pp = cfg.parallel.shard_teacher, cfg.parallel.tp, cfg.parallel.pp
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"parallel.shard_teacher={setting!r}: use auto, true or false")
    if setting is not True and (setting is False or tp == 1 or pp > 1):
        return False
    if setting is True:
        return True  # config checks refused tp == 1 and pp > 1
    from .memory import least_device_memory

    return teacher_fp32_bytes(arch) > AUTO_SHARE * least_device_memory(device)


def load_tensor_parallel(path: str | os.PathLike, ctx: ParallelContext, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> TensorParallelHybridLM:
    """The megatron_tc checkpoint at `path` as a tensor-parallel HybridLM (eval mode, `dtype`, on
    `device`) over ctx's TP group, reading only this rank's slice; the host holds one tensor at a
    time when `device` is a GPU. The vocabulary is padded for ctx.tp_size (`pad_vocab(vocab, tp)`),
    as the checkpoint's own layout for that TP size would be."""
    import dataclasses

    from megatron_tc.convert.checkpoint import VOCAB_MULTIPLE, load_slices, read_info
    from megatron_tc.model.config import pad_vocab

    if ctx.pp_size != 1:
        raise ValueError(f"a sharded teacher is split over tensor-parallel ranks only; parallel.pp={ctx.pp_size} "
                         "must be 1 (or set parallel.shard_teacher=false)")
    info = read_info(path)
    tp = ctx.tp_size
    check_heads_divisible(info.arch, tp)
    arch = dataclasses.replace(info.arch, padded_vocab_size=pad_vocab(info.arch.vocab_size, tp, VOCAB_MULTIPLE))
    with torch.device("meta"):
        model = HybridLM(arch)
        apply_tensor_parallel(model, ctx)  # megatron layers allocate on the meta device too: no storage
    params = dict(model.named_parameters())

    def my_slice(name: str, whole):
        """apply_tensor_parallel's cut: this rank's contiguous 1/TP along the partitioned dimension."""
        param = params.get(name)
        if param is None or not getattr(param, "tensor_model_parallel", False):
            return whole
        size = whole.shape[param.partition_dim] // tp
        return whole.narrow(param.partition_dim, ctx.tp_rank * size, size)

    # straight into dtype (no second copy) and onto the device one tensor at a time
    state = load_slices(path, my_slice, arch.padded_vocab_size, dtype, device)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise ValueError(f"{path}: rank {ctx.tp_rank}'s slice does not fit the tensor-parallel teacher ({diff})")
    _materialize(model, state, dtype, torch.device(device))
    for layer in model.layers:  # RoPE tables are buffers, not weights: computed (fp32) where they now live
        if isinstance(layer.mixer, Attention):
            layer.mixer.rope.reset_buffers(device)
    return model.eval()


def _materialize(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter of `model` by its tensor from `state` (floating ones in
    `dtype`), keeping the attributes megatron set on it (tensor_model_parallel, partition_dim):
    `Module.to_empty` would make new Parameters without them. The teacher is frozen, so the
    gradient hooks of replicated per-head norms are not carried over."""
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            value = state.pop(f"{prefix}.{name}" if prefix else name)
            value = value.to(device, dtype if value.is_floating_point() else value.dtype)
            new = nn.Parameter(value, requires_grad=param.requires_grad)
            new.__dict__.update(param.__dict__)
            module._parameters[name] = new
    if state:
        raise ValueError(f"tensors left without a parameter: {sorted(state)[:4]}")


def check_heads_divisible(arch: ArchConfig, tp: int) -> None:
    """Raise ValueError (one line) unless `tp` divides every dimension a sharded teacher splits."""
    import math

    sizes = {"attention heads": arch.num_heads, "KV heads": arch.num_kv_heads, "MLP width": arch.intermediate_size}
    bad = [f"{count} {what}" for what, count in sizes.items() if count % tp]
    if bad:
        common = math.gcd(*sizes.values())
        valid = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(f"parallel.tp={tp} does not divide the teacher's {', '.join(bad)}, which a sharded teacher "
                         f"splits over the tensor-parallel ranks: choose parallel.tp from {valid}")


def full_mixer(model: nn.Module, index: int, tp_group: dist.ProcessGroup | None) -> Attention:
    """Layer `index`'s attention as a single-device module (same dtype and device), gathered from a
    tensor-parallel teacher over `tp_group` (a collective), or the layer itself when not sharded."""
    mixer = model.layers[index].mixer
    if tp_group is None or dist.get_world_size(tp_group) == 1 or not isinstance(model, TensorParallelHybridLM):
        return mixer
    if not isinstance(mixer, Attention):
        raise TypeError(f"layer {index} of the teacher is {type(mixer).__name__}, not attention")
    params = dict(mixer.named_parameters())
    state = {name: torch.cat(all_gather(tensor, tp_group), dim=params[name].partition_dim)
             if is_tensor_parallel(params.get(name, tensor)) else tensor
             for name, tensor in mixer.state_dict().items()}
    weight = mixer.o_proj.weight
    with torch.device("meta"):
        full = Attention(model.arch, index)
    full = full.to_empty(device=weight.device).to(weight.dtype)
    full.load_state_dict(state)
    full.rope.reset_buffers(weight.device)
    return full.eval()

