"""HF model (teacher family, or an exported hybrid student) -> megatron_tc checkpoint.

Safetensors sources are converted one tensor at a time: each output shard's tensors are read
slice by slice from the HF files (`lazy.py`), so the resident memory is bounded by the largest
tensor of one rank, not by the model."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from megatron_tc.convert import layout
from megatron_tc.convert.checkpoint import is_checkpoint, lazy_checkpoint, read_info, resolve_dtype, save_checkpoint
from megatron_tc.convert.fsutil import check_output_dir
from megatron_tc.convert.gguf_memo import gguf_reading
from megatron_tc.convert.hf_io import HFModel, read_hf, read_hf_config
from megatron_tc.convert.hf_mapping import HFMappingError, arch_from_hf_config, hf_to_tc_names
from megatron_tc.convert.lazy_layout import Lazies
from megatron_tc.convert.hf_student import MODEL_TYPE as STUDENT_MODEL_TYPE
from megatron_tc.convert.hf_student import arch_of as student_arch
from megatron_tc.model.config import ArchConfig

log = logging.getLogger(__name__)


def arch_of_hf_config(config: Any) -> ArchConfig:
    """ArchConfig of a teacher-family config or of an exported student's config."""
    if config.model_type == STUDENT_MODEL_TYPE:
        return student_arch(config)
    return arch_from_hf_config(config)


def read_arch(path: str | os.PathLike) -> ArchConfig:
    """The ArchConfig of a megatron_tc checkpoint, an HF model directory, or a .gguf file (or a
    directory holding one), without reading weights (a GGUF's header is parsed: seconds)."""
    if is_checkpoint(path):
        return read_info(path).arch
    return arch_of_hf_config(read_hf_config(path)[0])


def hybrid_state_from_hf(model: HFModel) -> tuple[ArchConfig, Lazies]:
    """(arch, unsharded HybridLM lazy tensors) of a model read by `read_hf`; the vocabulary rows
    are as the source has them (`save_checkpoint` pads them)."""
    arch = arch_of_hf_config(model.config)
    if model.config.model_type == STUDENT_MODEL_TYPE:
        prefix = "model."
        bad = [k for k in model.state if not k.startswith(prefix)]
        if bad:
            raise ValueError(f"exported student has tensors outside `model.`: {bad[:5]}")
        return arch, {k[len(prefix):]: v for k, v in model.state.items()}
    names = hf_to_tc_names(set(model.state), arch)
    rows = model.state["model.embed_tokens.weight"].shape[0]
    if rows != arch.vocab_size:
        raise HFMappingError(f"embed_tokens has {rows} rows but arch.vocab_size is {arch.vocab_size}")
    return arch, {tc: model.state[hf] for tc, hf in names.items()}


def convert_hf_to_megatron(hf: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1, *,
                           dtype: str | torch.dtype | None = None, overwrite: bool = False,
                           progress: bool = False) -> Path:
    """Read `hf` (HF dir, .gguf, or dir with one .gguf) and write a (tp, pp) checkpoint at `out`.

    The output directory, the architecture and TP/PP are checked before any weight is read."""
    check_output_dir(out, overwrite)
    resolve_dtype(dtype)
    with gguf_reading():  # a GGUF's header is parsed once for the config, weights and tokenizer
        config, location = read_hf_config(hf)
        arch = arch_of_hf_config(config)
        layout.check_tp(arch, tp)
        layout.stage_ranges(arch, pp)
        start = time.perf_counter()
        model = read_hf(hf, (config, location))
    arch, state = hybrid_state_from_hf(model)
    log.info("read %s (%s, %d tensors) in %.1f s", hf, model.source["format"], len(state), time.perf_counter() - start)
    start = time.perf_counter()
    source = {"family": arch.family, **model.source}
    out = save_checkpoint(state, arch, out, tp, pp, dtype=dtype, source=source,
                          tokenizer_files=model.tokenizer_files, overwrite=overwrite, progress=progress)
    log.info("sharded and wrote %d files (sha256 included) in %.1f s", tp * pp, time.perf_counter() - start)
    return out


def load_hybrid_lm(path: str | os.PathLike, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A single-device `HybridLM` (eval mode) from a megatron_tc checkpoint (every shard verified).

    Floating weights get `dtype` (default fp32). The model is built on the meta device and each
    weight is read straight into its final dtype, so the peak memory is the model plus one tensor."""
    from megatron_tc.model import HybridLM
    from megatron_tc.model.attention import Attention

    info, lazies = lazy_checkpoint(path)
    with torch.device("meta"):
        model = HybridLM(info.arch)
    want = dtype or torch.float32
    state = {name: lazy.materialize(want if lazy.dtype.is_floating_point else None) for name, lazy in lazies.items()}
    model.load_state_dict(state, strict=True, assign=True)
    for layer in model.layers:  # RoPE tables are buffers, not weights: recomputed (fp32) off the meta device
        if isinstance(layer.mixer, Attention):
            layer.mixer.rope.reset_buffers(layer.mixer.q_proj.weight.device)
    return model.to(device=device).eval()
