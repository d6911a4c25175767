"""Compare a converted checkpoint with its HF original on a fixed prompt set.

The prompts: `num_random` sequences of random token ids (fixed seed) and, when a tokenizer is
available, a few English sentences. Both models run in fp32 on CPU; the result holds the max
absolute logit difference and the top-1 (argmax) agreement over all positions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning the Universe was created. This has made a lot of people very angry.",
    "def add(a, b):\n    return a + b\n",
)


@dataclass
class VerifyResult:
    max_abs_diff: float
    top1_agreement: float  # fraction of positions where both argmaxes agree
    positions: int
    prompts: int

    def passed(self, tol: float) -> bool:
        return self.max_abs_diff <= tol

    def summary(self) -> str:
        return (f"max |logit diff| = {self.max_abs_diff:.3e}, top-1 agreement = {self.top1_agreement:.4f} "
                f"({self.positions} positions, {self.prompts} prompts)")


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """(transformers model in eval mode, tokenizer or None) from an HF dir or GGUF."""
    import megatron_tc  # noqa: F401  (exported students resolve to our registered classes)
    from transformers import AutoModelForCausalLM

    from megatron_tc.convert.hf_io import locate

    loc = locate(path)
    kwargs = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(loc.directory), dtype=dtype, **kwargs).eval()
    return model, try_tokenizer(loc.directory, **kwargs)


def try_tokenizer(directory: str | os.PathLike, **kwargs: Any) -> Any:
    """An HF tokenizer from `directory`, or None when it holds none (prompts are then random ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except Exception:  # noqa: BLE001 - transformers raises many kinds here; no tokenizer is fine
        return None


def prompt_set(vocab_size: int, tokenizer: Any = None, num_random: int = 4, seq_len: int = 32,
               seed: int = 1234) -> list[torch.Tensor]:
    """Fixed prompts, each [1, T]: random ids, then the sentences when a tokenizer exists."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (1, seq_len), generator=gen) for _ in range(num_random)]
    if tokenizer is not None:
        for text in SENTENCES:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            if ids.numel() and int(ids.max()) < vocab_size:
                prompts.append(ids)
    return prompts


@torch.no_grad()
def compare_models(hf_model: torch.nn.Module, converted: torch.nn.Module, prompts: list[torch.Tensor]) -> VerifyResult:
    max_diff, agree, total = 0.0, 0, 0
    for ids in prompts:
        want = hf_model(input_ids=ids, use_cache=False).logits.float()
        got = converted(ids).float()
        if got.shape != want.shape:
            raise ValueError(f"logit shapes differ: HF {list(want.shape)}, megatron_tc {list(got.shape)}")
        max_diff = max(max_diff, (got - want).abs().max().item())
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += ids.numel()
    return VerifyResult(max_abs_diff=max_diff, top1_agreement=agree / max(total, 1), positions=total, prompts=len(prompts))


def verify_conversion(hf: str | os.PathLike, ckpt: str | os.PathLike, num_random: int = 4,
                      seq_len: int = 32, seed: int = 1234) -> VerifyResult:
    """Build the HF model from `hf` and HybridLM from checkpoint `ckpt`; compare logits in fp32."""
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    converted = load_hybrid_lm(ckpt, dtype=torch.float32)
    hf_model, tokenizer = load_hf_model(hf)
    if tokenizer is None and (Path(ckpt) / "tokenizer").is_dir():
        tokenizer = try_tokenizer(Path(ckpt) / "tokenizer")
    prompts = prompt_set(converted.arch.vocab_size, tokenizer, num_random, seq_len, seed)
    return compare_models(hf_model, converted, prompts)
