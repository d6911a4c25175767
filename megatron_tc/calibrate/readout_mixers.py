"""The readout mixers of sweep 2: each converted layer's GDN mixer with a strategy's closed-form
parameters, built from the teacher's weights where they are (nothing here waits for the device),
and the teacher attention's per-head output the readout sums compare it with."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_tc.model.gdn import GatedDeltaNet

from .readout import NARROW_DTYPES, WideLinear
from .statsfile import TaylorStats
from .strategies import LayerContext, Strategy, default_gdn_state, get_strategy


def _mixer_state(mixer: nn.Module) -> dict[str, torch.Tensor]:
    """A whole teacher mixer's weights where they are (no copy: strategies clone what they keep).
    Copying them to the CPU would wait for every kernel queued on the device."""
    return {k: v.detach() for k, v in mixer.state_dict(keep_vars=True).items()}  # one detach each


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a CPU tensor goes to a GPU without waiting for the kernels queued
    there: an asynchronous copy from pageable memory is staged by the driver before it returns (no
    pinned allocation, no wait for the device), where a blocking copy synchronizes the stream."""
    if tensor.device == device or tensor.is_meta:  # meta: a placeholder the readout never reads
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)


def model_device(model: nn.Module) -> torch.device:
    """Where the teacher's weights are: every sum and helper module of the pass lives there."""
    return next(model.parameters()).device


NARROW_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def readout_closed_forms(strategies: Sequence[Strategy]) -> dict[str, Strategy]:
    """{readout name: the strategy whose closed form gives its readout mixers} for every strategy
    needing readout sums (strategies sharing a closed form share one entry)."""
    out: dict[str, Strategy] = {}
    for strategy in strategies:
        if strategy.needs_readout and strategy.readout_name not in out:
            same = strategy.readout_name == strategy.name
            out[strategy.readout_name] = strategy if same else get_strategy(strategy.readout_name)
    return out


def readout_mixer(strategy: Strategy, stats: TaylorStats, model: nn.Module, student_arch, index: int,
                  seed: int = 0, teacher_mixer: nn.Module | None = None,
                  default: Mapping[str, torch.Tensor] | None = None,
                  into: GatedDeltaNet | None = None) -> tuple[GatedDeltaNet, list]:
    """Layer `index`'s GDN mixer with the strategy's closed-form parameters and its output-gate
    candidates, in fp32 on the teacher's device. The closed form reads the teacher's weights on
    their device and the statistics and default init on the CPU; nothing here waits for the device.
    teacher_mixer: the layer's whole teacher attention (default: `model`'s own layer). default: the
    layer's `default_gdn_state(student_arch, index, seed)`, when the caller already has it.
    into: a readout mixer of this closed form (another layer's) whose parameters are replaced
    instead of building a module (its previous layer's parameters are gone)."""
    ctx = layer_context(stats, model, student_arch, index, seed, teacher_mixer, default)
    params = strategy.closed_form(ctx)
    candidates = strategy.gate_candidates(ctx, params)
    moved = to_device_all(device_tensors(params, candidates), model_device(model))
    return mixer_with(strategy, student_arch, index, params, candidates, moved, into)


def layer_context(stats: TaylorStats, model: nn.Module, student_arch, index: int, seed: int = 0,
                  teacher_mixer: nn.Module | None = None, default: Mapping[str, torch.Tensor] | None = None
                  ) -> LayerContext:
    """What a closed form of layer `index` reads (`readout_mixer`'s arguments); read only: a readout
    mixer keeps the teacher's weights it copies as they are, without a copy."""
    teacher_mixer = model.layers[index].mixer if teacher_mixer is None else teacher_mixer
    default = default_gdn_state(student_arch, index, seed) if default is None else default
    return LayerContext(index, student_arch, _mixer_state(teacher_mixer), default, stats, read_only=True)


def device_tensors(params: Mapping[str, torch.Tensor], candidates: list) -> dict[str, torch.Tensor]:
    """What of a closed form goes to the device: every parameter and each candidate (`candidate.{i}`)."""
    return dict(params) | {f"candidate.{i}": c for i, c in enumerate(candidates) if c is not None}


def mixer_with(strategy: Strategy, student_arch, index: int, params: Mapping[str, torch.Tensor], candidates: list,
               moved: Mapping[str, torch.Tensor], into: GatedDeltaNet | None = None) -> tuple[GatedDeltaNet, list]:
    """The readout mixer of a closed form's parameters and candidates, `moved`: their
    `device_tensors` on the device; into: a module to take them (else one is built)."""
    if into is None:
        with torch.device("meta"):  # every weight comes from `params`: no init, no RNG use
            mixer = GatedDeltaNet(student_arch, index, init=False).eval()
    else:
        mixer, mixer.layer_idx = into, index
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(mixer, name).__class__ = WideLinear
    # the parameters become `params`' tensors in the mixer's dtype (no second copy on the device),
    # but for q/k/v projection weights the closed form gave in a 16-bit float dtype (copied from
    # the teacher): their values are exact there, and the projections run there (`wide_linear`)
    narrow = {k: params[k].dtype for k in NARROW_WEIGHTS if k in params and params[k].dtype in NARROW_DTYPES}
    assign_parameters(mixer, {k: moved[k] for k in params}, narrow)
    mixer.value_groups = student_arch.gdn_kv_heads // student_arch.num_kv_heads if strategy.values_repeat_kv else 1
    return mixer, [None if c is None else moved[f"candidate.{i}"] for i, c in enumerate(candidates)]


def shell_like(mixer: nn.Module) -> nn.Module:
    """A module of `mixer`'s structure for `mixer_with(..., into=)` to fill, without running its
    constructor (whose Linear inits, on `meta`, cost the host about as much as the rest of a
    readout mixer's build): its own dicts of parameters, buffers and submodules, which share
    `mixer`'s tensors until assigned."""
    shell = object.__new__(type(mixer))  # no copy.copy: its pickling protocol costs more than the rest
    state = vars(shell)
    state.update(vars(mixer))
    # the dicts a readout mixer's build changes are the shell's own; the hook dicts stay shared
    # (nothing hooks a readout mixer); the slots `assign_parameters` keeps point at `mixer`'s submodules
    state.pop("_assign_slots", None)
    state.update(_parameters=dict(mixer._parameters), _buffers=dict(mixer._buffers),
                 _modules={name: shell_like(child) for name, child in mixer._modules.items()})
    return shell


def assign_parameters(mixer: nn.Module, tensors: Mapping[str, torch.Tensor],
                      dtypes: Mapping[str, torch.dtype] | None = None) -> None:
    """Every parameter and buffer of `mixer` becomes the tensor of its name in `tensors` (in its
    dtype, or dtypes[name]; no copy where that is the tensor's), as `load_state_dict(..., assign=True,
    strict=True)` but without its per-module walk, which took a fifth to a quarter of a readout
    mixer's build on the host (the name-to-module map is made once per mixer). Parameters come out
    without gradients."""
    slots = mixer.__dict__.get("_assign_slots")
    if slots is None:
        slots = {key: (mixer.get_submodule(key.rpartition(".")[0]), key.rpartition(".")[2], value.dtype)
                 for key, value in mixer.state_dict(keep_vars=True).items()}
        mixer.__dict__["_assign_slots"] = slots
    if tensors.keys() != slots.keys():
        missing, unexpected = sorted(slots.keys() - tensors.keys()), sorted(tensors.keys() - slots.keys())
        raise KeyError(f"parameters to assign differ from the module's: missing {missing}, unexpected {unexpected}")
    dtypes = dtypes or {}
    for key, value in tensors.items():
        module, name, dtype = slots[key]
        value = value.to(dtypes.get(key, dtype))
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[name] = value


def to_device_all(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`tensors` on `device`; to a GPU the CPU ones travel packed, one buffer per dtype (one
    asynchronous host-to-device copy instead of one per tensor, none waiting for the device)."""
    if device.type != "cuda":
        return {k: _to_device(v, device) for k, v in tensors.items()}
    return pack_to(tensors, device, non_blocking=True)


def to_device_each(groups: Sequence[Mapping[str, torch.Tensor]], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Each mapping of `groups` on `device`, all of them through one `to_device_all`."""
    moved = to_device_all({(i, key): value for i, group in enumerate(groups) for key, value in group.items()}, device)
    out: list[dict[str, torch.Tensor]] = [{} for _ in groups]
    for (i, key), value in moved.items():
        out[i][key] = value
    return out


def pack_to(tensors: Mapping[str, torch.Tensor], device: torch.device, non_blocking: bool
            ) -> dict[str, torch.Tensor]:
    """`tensors` with every CPU one moved to `device` through one buffer per dtype; the values come
    back as views of it, shapes and dtypes unchanged."""
    on_cpu = {k: v for k, v in tensors.items() if v.device.type == "cpu"}
    out = dict(tensors) | move_packed(on_cpu, device, non_blocking)
    return {k: _to_device(v, device) for k, v in out.items()}


def move_packed(tensors: Mapping[str, torch.Tensor], device: torch.device, non_blocking: bool = False
                ) -> dict[str, torch.Tensor]:
    """`tensors` on `device` through one flat buffer per dtype: one copy per dtype, not one per
    tensor (asynchronous with `non_blocking`, for CPU tensors); views of that buffer. From a
    GPU to the CPU the copy stages through pinned memory (a pageable copy stages through a driver
    buffer: 7.7 ms of device time for SmolLM2's finished sums on an H200), one wait covers every
    dtype, and the views are of one pageable buffer per dtype: the caller holds no pinned memory,
    and the host makes no allocation per tensor (hundreds of sums: a clone each is host time the
    device waits through)."""
    groups: dict[torch.dtype, list[str]] = {}
    for key, value in tensors.items():
        groups.setdefault(value.dtype, []).append(key)
    flats, waits, staged = {}, set(), set()
    for dtype, keys in groups.items():
        # torch's C++ flatten / unflatten: hundreds of views made without a Python call each
        flat = _flatten_dense_tensors([tensors[k] for k in keys])
        if flat.is_cuda and device.type == "cpu":
            flats[dtype] = torch.empty(flat.shape, dtype=dtype, pin_memory=True).copy_(flat, non_blocking=True)
            waits.add(flat.device)
            staged.add(dtype)
        else:
            moved = flat.to(device, non_blocking=non_blocking)
            # the flatten of one tensor is a view of it, moved to its own device itself: the caller gets a copy
            flats[dtype] = moved.clone() if moved.data_ptr() == tensors[keys[0]].data_ptr() else moved
    for source in waits:  # the non-blocking copies above are done before the CPU reads them
        torch.cuda.current_stream(source).synchronize()
    out = {}
    for dtype, keys in groups.items():
        flat = flats[dtype]
        if dtype in staged:
            flat = torch.empty(flat.shape, dtype=dtype).copy_(flat)
        out.update(zip(keys, _unflatten_dense_tensors(flat, [tensors[k] for k in keys])))
    return out


def teacher_heads(mixer: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                  heads: torch.Tensor | None = None) -> torch.Tensor:
    """The attention's per-head output y [B, H, T, D] on x [B, T, hidden]: a view of `heads` [B, T,
    H*D] (what the forward fed o_proj, kept by sweep 1) when given, else recomputed (the same
    q/k/v projection and attention call as the forward's: the same values)."""
    if heads is not None:
        b, t, _ = heads.shape
        return heads.view(b, t, mixer.num_heads, mixer.head_dim).transpose(1, 2)
    q, k, v = mixer.project_qkv(x, position_ids)
    idx = torch.arange(x.shape[1], device=x.device)
    return mixer.attend(q, k, v, idx, idx, doc_ids)
