"""`model.generate` speed: a teacher on transformers' best path against its exported hybrid student.

Teacher: transformers' LlamaForCausalLM with `cache_implementation="static"` (transformers then
compiles the decoding step). Student: the exported-student class (`MegatronTCForCausalLM`, the code
an export carries) with a quarter of the layers attention, its static cache and captured decoding
step. Same shapes, bf16, random weights (speed does not depend on the values), the same run.

Per model and batch size: one `generate` of `new_tokens` greedy tokens after a prompt of
`prompt` tokens; a logits processor stamps each step (after a device sync, which generate's own
stopping check makes anyway), so prefill (prompt -> first token) and the per-token decoding time
(median step after `warmup_steps`) come from the same call; repeated `repeats` times.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from megatron_tc.model.config import ArchConfig


def student_pattern(num_layers: int) -> str:
    """A quarter of the layers attention, layer 0 and every 4th (the `uniform` policy's spread)."""
    return "".join("A" if i % 4 == 0 else "G" for i in range(num_layers))


def teacher_model(arch: ArchConfig, device: torch.device, dtype: torch.dtype):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, max_position_embeddings=max(arch.max_position_embeddings, 140000),
        rms_norm_eps=arch.norm_eps, tie_word_embeddings=arch.tie_embeddings, rope_theta=arch.rope_theta)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


def student_model(arch: ArchConfig, device: torch.device, dtype: torch.dtype):
    from megatron_tc.convert.hf_student import MegatronTCConfig, MegatronTCForCausalLM

    config = MegatronTCConfig.from_arch(arch.with_pattern(student_pattern(arch.num_layers)))
    with torch.device(device):
        model = MegatronTCForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # decays in fla's default range, as a converted student has
        for layer in model.model.layers:
            if hasattr(layer.mixer, "A_log"):
                layer.mixer.A_log.uniform_(0, 2.7)
                layer.mixer.dt_bias.uniform_(-4, -2)
    return model


class StepClock:
    """A logits processor that records the time of every step (after a device sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def one_generate(model, ids: torch.Tensor, new_tokens: int, warmup_steps: int, **kwargs: Any) -> dict[str, float]:
    from transformers import LogitsProcessorList

    clock = StepClock(ids.device)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **kwargs)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][warmup_steps:]
    return {"prefill_ms": 1e3 * (clock.stamps[0] - start), "decode_ms": 1e3 * statistics.median(steps)}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_decode(model, kwargs: dict[str, Any], batch: int, prompt: int, new_tokens: int, repeats: int,
                 warmup_steps: int, vocab: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    runs = []
    for _ in range(repeats + 1):  # the first run compiles / captures; not reported
        ids = torch.randint(3, vocab, (batch, prompt), generator=gen).to(device)
        runs.append(one_generate(model, ids, new_tokens, warmup_steps, **kwargs))
    runs = runs[1:]
    decode = spread([r["decode_ms"] for r in runs])
    return {"batch": batch, "prompt": prompt, "decode_ms": decode, "tokens_per_s": 1e3 * batch / decode["median"],
            "prefill_ms": spread([r["prefill_ms"] for r in runs]),
            "captured_step": getattr(model, "_graph", None) is not None}
