"""Whether every window starts with BOS: one rule, read from the teacher's tokenizer.

Teachers whose tokenizer adds a BOS token (Gemma, Llama-3, most sentencepiece Llamas) were trained
on sequences that open with it, and their attention sinks on it. A window cut from the middle of a
text has no BOS of its own, so such a teacher scored on it is far off its training distribution
(Gemma-3 270M on English prose: perplexity 128 without, 58 with; docs/benchmarks.md). The rule
decides, once per run, whether every evaluation window, calibration row and training sequence
gets one:

* `auto` (the default): BOS exactly when the tokenizer adds it when encoding text with its special
  tokens. This is measured by encoding a probe, not read from `add_bos_token`: a Llama-3
  `tokenizer.json` adds BOS through its post-processor while `add_bos_token` reads False, and a GGUF
  file's `tokenizer.ggml.add_bos_token` reaches the tokenizer the same way.
* `true`: always (the tokenizer must define a BOS token); `false`: never (a window starts with whatever token it starts with).

`bos_id` below is the resolved rule: the BOS token id, or None for no BOS. The window and packing
functions take it (`megatron_tc.data.packing.pack_window`, `megatron_tc.eval.perplexity.make_windows`).
"""
from __future__ import annotations

from typing import Any

from .documents import DataError

_PROBES = ("a", "Hello world", "0")


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """True when `tokenizer(text)` (special tokens on) starts with the tokenizer's BOS token and the
    same text without special tokens does not. Works for fast, sentencepiece and GGUF-loaded
    tokenizers alike, whichever way they add it (flag, post-processor, template)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    for probe in _PROBES:
        with_special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        if plain and plain[0] != bos:
            return with_special[:1] == [bos]
    return False


def parse_bos_setting(setting: Any) -> str | bool:
    """'auto' | True | False from a config value or a command-line string; anything else is an error."""
    if isinstance(setting, bool):
        return setting
    if isinstance(setting, str) and setting.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[setting.lower()]
    raise DataError(f"bos setting {setting!r} is not known; use auto (BOS when the tokenizer adds one), "
                    "true or false")


def resolve_bos_id(tokenizer: Any, setting: Any = "auto") -> int | None:
    """The BOS id every window starts with under `setting`, or None for no BOS."""
    setting = parse_bos_setting(setting)
    if setting is False:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if setting is True and bos is None:
        raise DataError("bos=true but the tokenizer defines no BOS token; use bos=auto or bos=false, or a "
                        "tokenizer with a bos_token")
    if setting == "auto" and not tokenizer_adds_bos(tokenizer):
        return None
    return int(bos)


def bos_record(bos_id: int | None, setting: Any = "auto") -> dict[str, Any]:
    """What results files record about the convention: {"bos": bool, "bos_token_id", "bos_setting"}."""
    return {"bos": bos_id is not None, "bos_token_id": bos_id, "bos_setting": parse_bos_setting(setting)}
