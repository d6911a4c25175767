"""Load a model for evaluation from a path: an HF directory, a GGUF file, or a megatron_tc checkpoint.

Everything in `megatron_tc.eval` scores a *logits callable*, `logits = forward(input_ids)` with
`input_ids [B, T]` (int64) and `logits [B, T, V]`, so the same code evaluates HF teachers, exported
students and our own `HybridLM`. `load_model` wraps each kind of path into a `LoadedModel` holding
that callable, the module, a tokenizer when one can be found, and a greedy `generate` that uses the
model's own cache.

Kinds of path:
- megatron_tc checkpoint (`manifest.json` whose format is "megatron_tc", plus `config.json`):
  `megatron_tc.convert.checkpoint.load_checkpoint` (every shard's sha256 verified) into a
  single-device `HybridLM`; its tokenizer comes from the checkpoint's `tokenizer/` when present.
- HF directory (has `config.json`): `AutoModelForCausalLM.from_pretrained` after `import megatron_tc`
  (so exported hybrid students resolve to our registered classes).
- GGUF: a `.gguf` file, or a directory holding exactly one `.gguf` file (transformers' `gguf_file=`).
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64, "fp64": torch.float64}


class ModelLoadError(ValueError):
    """A path that cannot be loaded as a model or tokenizer for evaluation."""


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    forward: `input_ids [B, T] -> logits [B, T, V]` (no grad, on `device`).
    generate: `(input_ids [1, T], max_new_tokens) -> new token ids [1, N]`, greedy, with the
        model's cache; None when the model has no cached generate (then callers fall back to a
        full forward per step, see `greedy_generate`).
    """

    forward: LogitsFn
    module: torch.nn.Module
    tokenizer: Any | None
    kind: str  # "hf" | "gguf" | "megatron_tc"
    path: str
    device: torch.device
    generate: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not known; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def detect_kind(path: str | os.PathLike) -> tuple[str, Path, str | None]:
    """Return (kind, directory, gguf_file_name or None) for a model path, or raise ModelLoadError."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist; give an HF directory, a .gguf file "
                             "or a megatron_tc checkpoint directory")
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf", p.parent, p.name
        raise ModelLoadError(f"{str(p)!r} is a file but not a .gguf; give a model directory instead")
    if _is_megatron_tc_checkpoint(p):
        return "megatron_tc", p, None
    if (p / "config.json").is_file():
        return "hf", p, None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", p, ggufs[0].name
    if len(ggufs) > 1:
        raise ModelLoadError(f"{str(p)!r} holds several .gguf files ({', '.join(g.name for g in ggufs)}); "
                             "pass the file itself")
    raise ModelLoadError(f"{str(p)!r} is neither an HF directory (config.json), a megatron_tc checkpoint "
                         "(manifest.json) nor a directory with one .gguf file")


def _is_megatron_tc_checkpoint(p: Path) -> bool:
    if not ((p / "manifest.json").is_file() and (p / "config.json").is_file()):
        return False
    try:
        return json.loads((p / "manifest.json").read_text()).get("format") == "megatron_tc"
    except (OSError, ValueError):
        return True  # a damaged manifest: let the checkpoint loader name the problem


def load_tokenizer(path: str | os.PathLike) -> Any:
    """An HF tokenizer from an HF directory, a GGUF, or a checkpoint directory that carries one."""
    from transformers import AutoTokenizer

    kind, directory, gguf = detect_kind(path)
    if kind == "megatron_tc":
        if not (directory / "tokenizer").is_dir():
            raise ModelLoadError(f"megatron_tc checkpoint {str(path)!r} carries no tokenizer/; pass --tokenizer DIR "
                                 "(e.g. the teacher's HF directory)")
        directory = directory / "tokenizer"
    try:
        if gguf is not None:
            return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf)
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"no tokenizer could be loaded from {str(path)!r} ({kind}): {exc}. "
                             "Pass --tokenizer DIR (e.g. the teacher's HF directory).") from exc


def _hf_generate(model: torch.nn.Module) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def generate(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             use_cache=True, pad_token_id=0)
        return out[:, input_ids.shape[1]:]

    return generate


def _load_hf(directory: Path, gguf: str | None, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import megatron_tc  # noqa: F401  (registers exported hybrid students with the Auto classes)
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    _import_optional("megatron_tc.convert")  # exported students register their classes there
    model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
    return model.to(device).eval()


def _import_optional(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _load_megatron_tc(directory: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from megatron_tc.convert.checkpoint import load_checkpoint
    from megatron_tc.model import HybridLM

    arch, state = load_checkpoint(directory)
    model = HybridLM(arch)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "float32", tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Load `path` for evaluation. `tokenizer` overrides where the tokenizer comes from."""
    kind, directory, gguf = detect_kind(path)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype)
    if kind == "megatron_tc":
        module = _load_megatron_tc(directory, device, torch_dtype)

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return module(ids)

        generate = _hybrid_generate(module)
    else:
        module = _load_hf(directory, gguf, device, torch_dtype)

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return module(input_ids=ids, use_cache=False).logits

        generate = _hf_generate(module)
    tok = None
    tok_path = tokenizer if tokenizer is not None else path
    try:
        tok = load_tokenizer(tok_path)
    except ModelLoadError:
        if tokenizer is not None:
            raise
    return LoadedModel(forward=torch.no_grad()(forward), module=module, tokenizer=tok, kind=kind,
                       path=str(path), device=device, generate=generate,
                       info={"dtype": str(torch_dtype).replace("torch.", "")})


def _hybrid_generate(module: torch.nn.Module) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Greedy decoding with `HybridCache` (megatron_tc.model.generate): one prefill, then one token per step."""
    from megatron_tc.model.generate import generate as hybrid_generate

    @torch.no_grad()
    def generate(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return hybrid_generate(module, input_ids, max_new_tokens)[:, input_ids.shape[1]:]

    return generate


@torch.no_grad()
def greedy_generate(forward: LogitsFn, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding by a full forward per step (no cache): the fallback for bare callables.

    input_ids [B, T] -> new ids [B, max_new_tokens].
    """
    ids = input_ids
    for _ in range(max_new_tokens):
        nxt = forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, input_ids.shape[1]:]
