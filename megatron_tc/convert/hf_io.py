"""Read a Hugging Face model from disk: safetensors (single or sharded with an index), pytorch
.bin, or GGUF (a .gguf file, or a directory holding exactly one; transformers dequantizes it).

`read_hf_config` is cheap (no weights) and rejects unsupported architectures, so callers can
check TP/PP before loading anything; `read_hf` returns the config, the weights under HF names as
lazy tensors (`lazy.py`: safetensors are read slice by slice when written out, pytorch .bin files
are memory-mapped; GGUF is dequantized in memory by transformers) and the tokenizer files (as
bytes, to be carried into the checkpoint).
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_tc.convert.errors import ConversionError
from megatron_tc.convert.fsutil import sha256_file, sha256_files
from megatron_tc.convert.gguf_memo import gguf_reading
from megatron_tc.convert.hf_mapping import MODEL_TYPES
from megatron_tc.convert.hf_student import MODEL_TYPE as STUDENT_MODEL_TYPE
from megatron_tc.convert.lazy import LazyTensor, SafetensorsFile, lazy_state

SUPPORTED_MODEL_TYPES = tuple(sorted(MODEL_TYPES)) + (STUDENT_MODEL_TYPE,)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
StateDict = dict[str, torch.Tensor]


@dataclass
class HFLocation:
    directory: Path
    gguf_file: str | None  # file name inside `directory`, or None for safetensors / .bin

    @property
    def kind(self) -> str:
        return "gguf" if self.gguf_file else "hf"


@dataclass
class HFModel:
    config: Any  # a transformers PreTrainedConfig
    state: dict[str, LazyTensor]  # HF names (tied models: no lm_head.weight)
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)  # format, path, sha256, model_type, hf_config


def locate(path: str | os.PathLike) -> HFLocation:
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"{p} does not exist; give an HF model directory, a .gguf file or a directory holding one")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ConversionError(f"{p} is a file but not a .gguf; give the model directory instead")
        return HFLocation(p.parent, p.name)
    if (p / "config.json").is_file():
        return HFLocation(p, None)
    ggufs = sorted(q.name for q in p.glob("*.gguf"))
    if len(ggufs) == 1:
        return HFLocation(p, ggufs[0])
    if ggufs:
        raise ConversionError(f"{p} holds several .gguf files ({', '.join(ggufs)}); pass the file itself")
    raise ConversionError(f"{p} has no config.json and no .gguf file: not a Hugging Face model directory")


def _unsupported(model_type: Any, where: Path) -> ConversionError:
    return ConversionError(
        f"{where}: architecture {model_type!r} is not supported; supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (families llama, qwen2, mistral, qwen3, gemma3, and exported "
        "megatron_tc hybrid students)"
    )


def read_hf_config(path: str | os.PathLike) -> tuple[Any, HFLocation]:
    """(transformers config, location) without loading weights; unsupported model types raise."""
    import megatron_tc  # noqa: F401  (registers the student config with AutoConfig)
    from transformers import AutoConfig

    loc = locate(path)
    if loc.gguf_file is None:
        raw = json.loads((loc.directory / "config.json").read_text())
        if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise _unsupported(raw.get("model_type"), loc.directory / "config.json")
        return AutoConfig.from_pretrained(str(loc.directory)), loc
    try:
        config = AutoConfig.from_pretrained(str(loc.directory), gguf_file=loc.gguf_file)
    except ValueError as err:  # transformers names the GGUF architecture it cannot map
        raise ConversionError(f"{loc.directory / loc.gguf_file}: {err}; supported model types: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}") from err
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(config.model_type, loc.directory / loc.gguf_file)
    return config, loc


def _weight_files(directory: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (directory / n).is_file()]
            if missing:
                raise ConversionError(f"{index} lists {missing} but they are not in {directory}")
            return [directory / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (directory / single).is_file():
            return [directory / single]
    raise ConversionError(f"{directory} has no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")


def _lazy_weights(files: list[Path]) -> dict[str, LazyTensor]:
    """Every weight file's tensors as lazy tensors; nothing is read but headers (.bin files are
    memory-mapped, so only the pages a slice touches are read)."""
    state: dict[str, LazyTensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            part = SafetensorsFile(file).leaves()
        else:
            part = lazy_state(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        twice = sorted(set(part) & set(state))
        if twice:
            raise ConversionError(f"{file} holds tensors that another weight file also holds: {twice[:5]}")
        state.update(part)
    return state


def _tokenizer_files(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}


def _read_gguf(loc: HFLocation, config: Any) -> tuple[StateDict, dict[str, bytes]]:
    """Dequantize through transformers (fp32) and save the GGUF's tokenizer as HF files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_reading(), tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(str(loc.directory), gguf_file=loc.gguf_file, dtype=torch.float32)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the same tensor as the embedding, as save_pretrained drops it
        del model
        try:
            AutoTokenizer.from_pretrained(str(loc.directory), gguf_file=loc.gguf_file).save_pretrained(tmp)
        except Exception as err:  # noqa: BLE001 - the weights are still worth converting
            warnings.warn(f"{loc.gguf_file}: its tokenizer could not be converted ({err!r}); "
                          "the checkpoint will carry no tokenizer", stacklevel=2)
        tokenizer = _tokenizer_files(Path(tmp))
    return state, tokenizer


def read_hf(path: str | os.PathLike, config_and_location: tuple[Any, HFLocation] | None = None) -> HFModel:
    """Config, HF-named lazy tensors (dtype as stored; GGUF dequantized to fp32) and tokenizer files.

    `config_and_location`: what `read_hf_config(path)` returned, to skip reading it again."""
    config, loc = config_and_location or read_hf_config(path)
    if loc.gguf_file is not None:
        tensors, tokenizer = _read_gguf(loc, config)
        state = lazy_state(tensors)
        digest, fmt = sha256_file(loc.directory / loc.gguf_file), "gguf"
        source_path = loc.directory / loc.gguf_file
    else:
        files = _weight_files(loc.directory)
        state, tokenizer = _lazy_weights(files), _tokenizer_files(loc.directory)
        digest, fmt = sha256_files(files), files[0].suffix.lstrip(".")
        source_path = loc.directory
    hf_config = config.to_dict()
    source = {"format": fmt, "path": str(Path(source_path).absolute()), "sha256": digest,
              "model_type": config.model_type, "hf_config": _jsonable(hf_config)}
    return HFModel(config=config, state=state, tokenizer_files=tokenizer, source=source)


def _jsonable(data: Any) -> Any:
    """The config dict as JSON can hold it (dtype objects -> names)."""
    return json.loads(json.dumps(data, default=lambda o: str(o).removeprefix("torch.")))
