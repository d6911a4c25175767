"""Load a teacher (megatron_tc checkpoint, HF directory or .gguf) as an all-attention HybridLM,
and turn a text file into calibration batches."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_tc.model import HybridLM

from .statsfile import state_dict_sha256


@dataclass
class Teacher:
    model: HybridLM
    sha256: str  # state_dict_sha256 of the HybridLM weights: the same for every file format
    tokenizer: Any
    tokenizer_files: dict[str, bytes]
    path: str


def _tokenizer_files(directory: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")
    return {n: (directory / n).read_bytes() for n in names if (directory / n).is_file()}


def load_teacher(path: str | os.PathLike) -> Teacher:
    """The teacher as a HybridLM (fp32, eval mode) with its weight hash and tokenizer."""
    from megatron_tc.eval.loading import detect_kind, load_tokenizer

    kind, directory, gguf = detect_kind(path)
    if kind == "megatron_tc":
        from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

        # every file (tokenizer too) verified before use; each weight read straight into the
        # model built on the meta device (peak: the fp32 model plus one tensor)
        model = load_hybrid_lm(directory, dtype=torch.float32)
        files = _tokenizer_files(directory / "tokenizer")
        return Teacher(model, weights_sha256(model), load_tokenizer(path), files, str(path))
    tokenizer = load_tokenizer(path)
    from transformers import AutoModelForCausalLM

    from megatron_tc.convert.hf_mapping import arch_from_hf_config, hf_to_tc_state_dict

    kwargs = {"gguf_file": gguf} if gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    arch = arch_from_hf_config(hf.config)
    state = hf_to_tc_state_dict(hf.state_dict(), arch)
    files = _tokenizer_files(directory)
    if not files and tokenizer is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = _tokenizer_files(Path(tmp))
    model = HybridLM(arch)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head")]:
        raise ValueError(f"teacher {path}: state dict does not fit HybridLM (missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.eval()
    return Teacher(model, weights_sha256(model), tokenizer, files, str(path))


def weights_sha256(model: HybridLM) -> str:
    """state_dict_sha256 of the weights without the vocabulary padding rows: the padding depends on
    TP and on the file format (HF has none), so the same teacher must hash the same without it."""
    vocab = model.arch.vocab_size
    state = {k: v[:vocab] if k in ("embed_tokens.weight", "lm_head.weight") else v for k, v in model.state_dict().items()}
    return state_dict_sha256(state)


def text_batches(
    path: str | os.PathLike, tokenizer: Any, tokens: int, seq_len: int, skip_tokens: int = 0, rows_per_batch: int = 1,
    bos_id: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Tokens skip_tokens .. skip_tokens+tokens of a text file as [rows, seq_len] batches (whole
    rows only; each row is a contiguous window, its first token the sink). With `bos_id` every row
    is BOS + seq_len - 1 tokens of the text (the evaluation windows' convention)."""
    from megatron_tc.eval.perplexity import make_windows, tokenize_file

    ids = tokenize_file(path, tokenizer, skip_tokens + tokens)[skip_tokens:]
    full = [w for w in make_windows(ids, seq_len, bos_id) if w.shape[1] == seq_len] if ids.numel() >= 2 else []
    if not full:
        raise ValueError(f"{path}: {ids.numel()} tokens after skipping {skip_tokens} is less than one row of {seq_len}")
    grid = full[0]
    rows = grid.shape[0]
    return [{"input_ids": grid[i : i + rows_per_batch]} for i in range(0, rows, rows_per_batch)]
