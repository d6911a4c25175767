"""Load a teacher (megatron_tc checkpoint, HF directory or .gguf) as an all-attention HybridLM,
and turn a text file into calibration batches."""
from __future__ import annotations

import os
from collections.abc import Mapping
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
    tp_group: Any = None  # the model is tensor-parallel over this group (load_sharded_teacher); None: whole

    @property
    def sharded(self) -> bool:
        return self.tp_group is not None


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


def load_sharded_teacher(path: str | os.PathLike, ctx: Any, device: torch.device | str = "cpu") -> Teacher:
    """The megatron_tc checkpoint at `path` split over ctx's tensor-parallel ranks (fp32, eval
    mode, on `device`; parallel.sharded_teacher.load_tensor_parallel): each rank reads only its
    slice, tensor by tensor onto the device. The weight hash is the whole teacher's
    (`weights_sha256`), streamed from the checkpoint on global rank 0 and broadcast (collective
    over the world)."""
    import torch.distributed as dist

    from megatron_tc.eval.loading import detect_kind, load_tokenizer
    from megatron_tc.parallel.sharded_teacher import load_tensor_parallel

    kind, directory, _ = detect_kind(path)
    if kind != "megatron_tc":
        raise ValueError(f"a sharded teacher is read from a megatron_tc checkpoint, {path} is {kind}; convert it first "
                         "(the convert stage, or tools/convert_hf_to_megatron.py)")
    from megatron_tc.parallel.state import shared_outcome

    # each rank verifies the files it reads; a damaged one stops every rank, not only its reader
    model = shared_outcome(lambda: load_tensor_parallel(directory, ctx, device=device))
    digest = [shared_outcome((lambda: checkpoint_weights_sha256(directory)) if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(digest, src=0)
    files = _tokenizer_files(directory / "tokenizer")
    return Teacher(model, digest[0], load_tokenizer(path), files, str(path), tp_group=ctx.tp_group)


def checkpoint_weights_sha256(path: str | os.PathLike, rows_per_read: int = 4096) -> str:
    """`weights_sha256` of the model a megatron_tc checkpoint loads as (fp32), computed from its
    files `rows_per_read` rows at a time (the digest of row-major bytes does not depend on how
    they are cut): peak memory a few MB, whatever the model."""
    import hashlib

    from megatron_tc.convert.checkpoint import lazy_checkpoint

    info, lazies = lazy_checkpoint(path)
    vocab = info.arch.vocab_size
    digest = hashlib.sha256()
    for name in sorted(lazies):
        lazy = lazies[name]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            lazy = lazy[:vocab]
        dtype = torch.float32 if lazy.dtype.is_floating_point else None
        digest.update(f"{name}:{list(lazy.shape)}\n".encode())  # as statsfile.state_dict_sha256
        if not lazy.shape:
            digest.update(lazy.materialize(dtype).numpy().tobytes())
        for start in range(0, lazy.shape[0] if lazy.shape else 0, rows_per_read):
            rows = lazy.narrow(0, start, min(rows_per_read, lazy.shape[0] - start))
            digest.update(rows.materialize(dtype).numpy().tobytes())
    return digest.hexdigest()


def whole_teacher_state(teacher: Teacher) -> "LazyState":
    """The whole weights of a (sharded) teacher read from its checkpoint by name, fp32, with the
    vocabulary padded as `teacher.model.arch` (what `calibrate.student.build_student` copies)."""
    from megatron_tc.convert.checkpoint import lazy_checkpoint
    from megatron_tc.convert.lazy_layout import resize_vocab_lazy
    from megatron_tc.eval.loading import detect_kind

    _, directory, _ = detect_kind(teacher.path)
    info, lazies = lazy_checkpoint(directory)
    return LazyState(resize_vocab_lazy(lazies, info.arch.vocab_size, teacher.model.arch.padded_vocab_size))


class LazyState(Mapping):
    """A state dict of lazy tensors (convert.lazy) read when looked up, floating ones as fp32."""

    def __init__(self, lazies: dict):
        self.lazies = lazies

    def __getitem__(self, name: str) -> torch.Tensor:
        lazy = self.lazies[name]
        return lazy.materialize(torch.float32 if lazy.dtype.is_floating_point else None)

    def __iter__(self):
        return iter(self.lazies)

    def __len__(self) -> int:
        return len(self.lazies)


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
