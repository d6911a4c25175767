"""megatron_tc checkpoint -> Hugging Face directory.

A teacher-shaped checkpoint (every layer 'A') becomes the original family's HF format
(Llama/Qwen2/Mistral/Qwen3/Gemma3 config.json + safetensors + tokenizer files), loadable by plain
transformers. A hybrid student becomes a `megatron_tc_hybrid` directory: config, weights,
tokenizer and the self-contained model code of `megatron_tc.export` (copied verbatim), so it
loads with `trust_remote_code=True` where only torch and transformers are installed, or with
`AutoModelForCausalLM.from_pretrained` after `import megatron_tc`.
The vocabulary padding of the checkpoint is removed in both cases. Weights are written one
tensor at a time, each read slice by slice from the checkpoint's shards (`lazy.py`), so exporting
holds one tensor, not the model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from megatron_tc.convert.checkpoint import lazy_checkpoint, load_checkpoint, read_info, resolve_dtype
from megatron_tc.convert.errors import ConversionError
from megatron_tc.convert.fsutil import atomic_output_dir, check_output_dir
from megatron_tc.convert.hf_mapping import HFMappingError, arch_from_hf_config, tc_to_hf_state_dict
from megatron_tc.convert.lazy_layout import Lazies
from megatron_tc.convert.safetensors_stream import target_dtype, write_safetensors
from megatron_tc.export import remote_code
from megatron_tc.model.config import ArchConfig

HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
MAX_SHARD_BYTES = 5 * 1024**3
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                 dtype: str | torch.dtype | None = None, as_student: bool = False, progress: bool = False) -> Path:
    """Write checkpoint `ckpt` as an HF directory at `out` (atomic; refuses an existing `out`).

    Teacher-shaped checkpoints get their family's format unless `as_student`; hybrids always get
    the megatron_tc_hybrid format. progress: a bar over the bytes written (rank 0, terminal only)."""
    check_output_dir(out, overwrite)
    cast = resolve_dtype(dtype)
    info, state = lazy_checkpoint(ckpt)
    state, arch = _unpad_vocab(state, info.arch)
    store_dtype = str(target_dtype(next(iter(state.values())), cast)).removeprefix("torch.")
    tokenizer = {rel: (info.path / "tokenizer" / rel).read_bytes() for rel in info.tokenizer_files}
    source_config = info.source.get("hf_config") or {}
    if info.is_teacher_shaped and not as_student:
        config = teacher_hf_config(arch, source_config)
        weights = tc_to_hf_state_dict(state, arch)
        if arch.tie_embeddings:
            weights.pop("lm_head.weight")  # the same tensor as the embedding; HF ties it on load
        code: dict[str, str] = {}
    else:
        config = student_hf_config(arch, source_config)
        weights = {f"model.{k}": v for k, v in state.items()}
        code = remote_code()
    config.dtype = store_dtype
    with atomic_output_dir(out, overwrite) as tmp:
        config.save_pretrained(str(tmp))
        save_weights(weights, tmp, cast, progress=progress)
        for name, data in tokenizer.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        for name, text in code.items():
            (tmp / name).write_text(text)
    return Path(out)


def student_model_from_checkpoint(ckpt: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Any:
    """The exported-student class (`MegatronTCForCausalLM`) built in memory from a megatron_tc
    checkpoint (any layer pattern, vocabulary padding removed): what an export would load, without
    writing one. For tools that take a transformers model object (lm-eval's HFLM, generate)."""
    from megatron_tc.convert.hf_student import MegatronTCForCausalLM

    info = read_info(ckpt)
    arch, state = load_checkpoint(ckpt)
    state, arch = _unpad_vocab(state, arch)
    model = MegatronTCForCausalLM(student_hf_config(arch, info.source.get("hf_config") or {}))
    model.model.load_state_dict(state)
    cast = resolve_dtype(dtype)
    return (model.to(cast) if cast is not None else model).eval()


def _unpad_vocab(state: Lazies, arch: ArchConfig) -> tuple[Lazies, ArchConfig]:
    """The embedding and head cut to the real vocabulary (lazy slices or tensors alike)."""
    out = dict(state)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = out[name].narrow(0, 0, arch.vocab_size)
    return out, dataclasses.replace(arch, padded_vocab_size=arch.vocab_size)


# ---- configs ------------------------------------------------------------------------------------
def _comparable(arch: ArchConfig) -> dict[str, Any]:
    return dataclasses.asdict(dataclasses.replace(arch, layer_pattern=arch.layer_kinds, padded_vocab_size=arch.vocab_size))


def _same_arch(a: ArchConfig, b: ArchConfig) -> list[str]:
    """Names of the fields where a and b differ (floats compared to 1e-12 relative)."""
    x, y = _comparable(a), _comparable(b)
    def same(u: Any, v: Any) -> bool:
        if isinstance(u, float) and isinstance(v, float):
            return math.isclose(u, v, rel_tol=1e-12)
        return u == v
    return [k for k in x if not same(x[k], y[k])]


def teacher_hf_config(arch: ArchConfig, source_config: dict[str, Any]) -> Any:
    """The family's HF config: the recorded source config when it still describes `arch`, else
    one built from `arch` (token ids carried over from the source)."""
    from transformers import AutoConfig

    if source_config:
        fields = {k: v for k, v in source_config.items() if k not in ("model_type", "transformers_version")}
        try:
            recorded = AutoConfig.for_model(source_config["model_type"], **fields)
            if not _same_arch(arch_from_hf_config(recorded), arch):
                recorded.architectures = [HF_CLASSES[arch.family][1]]
                return recorded
        except (HFMappingError, ValueError, TypeError, KeyError):
            pass  # fall through: build a config from arch
    extra = {k: source_config[k] for k in TOKEN_ID_KEYS if source_config.get(k) is not None}
    return hf_config_from_arch(arch, **extra)


def hf_config_from_arch(arch: ArchConfig, **extra: Any) -> Any:
    """The family's transformers config for an all-attention `arch`; verified by mapping it back."""
    import transformers

    if arch.family not in HF_CLASSES:
        raise ConversionError(f"family {arch.family!r} has no HF format; supported: {', '.join(HF_CLASSES)}")
    config_name, model_name = HF_CLASSES[arch.family]
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta, **(arch.rope_scaling or {})}
    fields: dict[str, Any] = dict(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_eps,
        tie_word_embeddings=arch.tie_embeddings, rope_parameters=rope,
    )
    if arch.family == "mistral":
        fields["sliding_window"] = arch.sliding_window
    if arch.family == "gemma3":
        scalar = arch.head_dim if arch.query_scale is None else arch.query_scale**-2
        fields.update(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar)) else scalar,
            sliding_window=arch.sliding_window, final_logit_softcapping=arch.final_logit_softcap,
            layer_types=[f"{arch.layer_type(i)}_attention" for i in range(arch.num_layers)],
            rope_parameters={"full_attention": rope,
                             "sliding_attention": {"rope_type": "default", "rope_theta": arch.rope_local_theta or arch.rope_theta}},
        )
    config = getattr(transformers, config_name)(**fields, **extra)
    config.architectures = [model_name]
    diff = _same_arch(arch_from_hf_config(config), arch)
    if diff:
        raise ConversionError(f"the {arch.family} HF format cannot express this architecture (differs in {diff})")
    return config


def student_hf_config(arch: ArchConfig, source_config: dict[str, Any]) -> Any:
    from megatron_tc.convert.hf_student import MegatronTCConfig

    extra = {k: source_config[k] for k in TOKEN_ID_KEYS if source_config.get(k) is not None}
    auto_map = {"AutoConfig": "configuration_megatron_tc.MegatronTCConfig",
                "AutoModelForCausalLM": "modeling_megatron_tc.MegatronTCForCausalLM"}
    return MegatronTCConfig.from_arch(arch, architectures=["MegatronTCForCausalLM"], auto_map=auto_map, **extra)


# ---- weights ------------------------------------------------------------------------------------
def save_weights(weights: Lazies, directory: Path, cast: torch.dtype | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past `max_shard_bytes`;
    each file written one tensor at a time (`cast`: dtype of the floating tensors, None: keep);
    progress: a bar over the bytes written."""
    from megatron_tc.monitor import progress as bar

    shards: list[Lazies] = [{}]
    size = total = 0
    for name, tensor in weights.items():
        nbytes = tensor.nbytes(target_dtype(tensor, cast))
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    with bar(total=total, desc="writing weights", unit="B", unit_scale=True, unit_divisor=1024,
             enabled=progress) as written:
        for name, shard in zip(names, shards):
            written.set_postfix_str(name, refresh=False)
            write_safetensors(directory / name, shard, cast, metadata={"format": "pt"}, written=written.update)
    if len(shards) == 1:
        return
    weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
