"""Synthetic long-context retrieval probe (associative recall / needle in a haystack).

A context of about L tokens lists key-value pairs, one per line ("bakodi = 4821"); the prompt ends
with one of the keys ("bakodi =") and the model must produce its value. Keys are made-up words,
values random numbers, all distinct inside a context, so nothing can be guessed from pretraining;
the queried pair sits at a uniformly random depth (recorded per sample). Scoring:

- "generate": greedy decoding of as many tokens as the value has, with the model's cache
  (HF `generate`, or HybridLM's cache: GDN layers keep constant-size state); exact match of ids.
- "rank": the summed log-likelihood of the gold value against `num_candidates - 1` other values
  from the same context (distractors the model has seen); correct if the gold one ranks first.

`run_probe` reports accuracy per length for each model (teacher and student) over the same examples.
With a BOS id (the teacher's tokenizer adds BOS, `megatron_tc.data.bos`) every prompt starts with it.
Lengths from 1k to 32k tokens are the intended use (on a GPU for real models); tests use tiny ones.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from megatron_tc.config.errors import InputError, command_line
from megatron_tc.eval.loading import LoadedModel, LogitsFn, greedy_generate
from megatron_tc.monitor import progress as bar

HEADER = "Memorize the codes below. Each line is a name, then =, then its code."
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def key_words(count: int, seed: int = 0, syllables: int = 3) -> list[str]:
    """`count` distinct made-up words of `syllables` consonant-vowel syllables."""
    total = (len(CONSONANTS) * len(VOWELS)) ** syllables
    if count > total:
        raise ValueError(f"only {total} words of {syllables} syllables exist; asked for {count}")
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < count:
        out.add("".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(syllables)))
    return sorted(out)


def value_words(digits: int) -> list[str]:
    return [str(v) for v in range(10 ** (digits - 1), 10**digits)]


@dataclass
class ProbeExample:
    prompt_ids: list[int]
    answer_ids: list[int]
    candidates: list[list[int]]  # candidates[gold] == answer_ids
    gold: int
    depth: float  # position of the queried pair in the list, 0 = first, 1 = last

    @property
    def context_tokens(self) -> int:
        return len(self.prompt_ids)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _split_answer(tokenizer: Any, prompt: str, answer: str, prompt_ids: list[int]) -> list[int]:
    """Ids of `answer` as they follow `prompt` when tokenized together (the lm-eval convention)."""
    whole = _encode(tokenizer, prompt + answer)
    if whole[: len(prompt_ids)] == prompt_ids and len(whole) > len(prompt_ids):
        return whole[len(prompt_ids):]
    return _encode(tokenizer, answer)


def make_example(tokenizer: Any, length: int, rng: random.Random, keys: Sequence[str], values: Sequence[str],
                 num_candidates: int = 4, bos_id: int | None = None) -> ProbeExample:
    """One prompt of about `length` tokens (never more, BOS included) listing distinct key-value pairs."""
    prefix = [] if bos_id is None else [bos_id]
    header = _encode(tokenizer, HEADER + "\n")
    budget = length - len(prefix) - len(header) - 8  # room for the query line
    order_k, order_v = rng.sample(list(keys), len(keys)), rng.sample(list(values), len(values))
    lines, used = [], 0
    for k, v in zip(order_k, order_v):
        n = len(_encode(tokenizer, f"{k} = {v}\n"))
        if used + n > budget:
            break
        lines.append((k, v))
        used += n
    if len(lines) < num_candidates:
        raise ValueError(f"length {length} fits only {len(lines)} pairs; need at least {num_candidates} "
                         "(raise the length or lower num_candidates), or add keys/values")
    q = rng.randrange(len(lines))
    key, value = lines[q]
    prompt = HEADER + "\n" + "".join(f"{k} = {v}\n" for k, v in lines) + f"{key} ="
    prompt_ids = prefix + _encode(tokenizer, prompt)
    while len(prompt_ids) > length and len(lines) > num_candidates:  # per-line counts were approximate
        drop = next(i for i in range(len(lines) - 1, -1, -1) if i != q)
        lines.pop(drop)
        q -= drop < q
        prompt = HEADER + "\n" + "".join(f"{k} = {v}\n" for k, v in lines) + f"{key} ="
        prompt_ids = prefix + _encode(tokenizer, prompt)
    others = rng.sample([v for i, (_, v) in enumerate(lines) if i != q], num_candidates - 1)
    gold = rng.randrange(num_candidates)
    texts = others[:gold] + [value] + others[gold:]
    candidates = [_split_answer(tokenizer, prompt, " " + t, prompt_ids[len(prefix):]) for t in texts]
    return ProbeExample(prompt_ids=prompt_ids, answer_ids=candidates[gold], candidates=candidates, gold=gold,
                        depth=q / max(1, len(lines) - 1))


def make_examples(tokenizer: Any, lengths: Sequence[int], samples: int, seed: int = 0, value_digits: int = 4,
                  num_candidates: int = 4, keys: Sequence[str] | None = None,
                  bos_id: int | None = None) -> dict[int, list[ProbeExample]]:
    """The same examples for every model: {length: [ProbeExample] * samples}; `bos_id` opens every prompt."""
    rng = random.Random(seed)
    keys = list(keys) if keys is not None else key_words(max(2000, max(lengths) // 3), seed=seed)
    values = value_words(value_digits)
    return {L: [make_example(tokenizer, L, rng, keys, values, num_candidates, bos_id) for _ in range(samples)]
            for L in lengths}


@torch.no_grad()
def score_generate(model: LoadedModel | LogitsFn, ex: ProbeExample, device: str | torch.device = "cpu") -> bool:
    ids = torch.tensor([ex.prompt_ids], device=device)
    n = len(ex.answer_ids)
    gen = model.generate if isinstance(model, LoadedModel) and model.generate is not None else None
    out = gen(ids, n) if gen is not None else greedy_generate(model, ids, n)
    return out[0].tolist() == ex.answer_ids


@torch.no_grad()
def score_rank(model: LoadedModel | LogitsFn, ex: ProbeExample, device: str | torch.device = "cpu") -> bool:
    rows = [ex.prompt_ids + c for c in ex.candidates]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r)  # right padding: causal logits of real positions unchanged
    logprobs = model(batch.to(device)).float().log_softmax(-1)
    p = len(ex.prompt_ids)
    scores = []
    for i, c in enumerate(ex.candidates):
        lp = logprobs[i, p - 1: p - 1 + len(c)]
        scores.append(float(lp.gather(-1, torch.tensor(c, device=lp.device)[:, None]).sum()))
    return max(range(len(scores)), key=scores.__getitem__) == ex.gold


def run_probe(models: Mapping[str, LoadedModel | LogitsFn], examples: Mapping[int, list[ProbeExample]],
              method: str = "generate", device: str | torch.device = "cpu", progress: bool = True) -> dict[str, Any]:
    """Accuracy per length for each model on the same examples (JSON-ready)."""
    score = {"generate": score_generate, "rank": score_rank}.get(method)
    if score is None:
        raise ValueError(f"method {method!r}: use 'generate' or 'rank'")
    lengths = sorted(examples)
    result: dict[str, Any] = {"method": method, "lengths": lengths,
                              "samples": {str(L): len(examples[L]) for L in lengths},
                              "context_tokens": {str(L): sum(e.context_tokens for e in examples[L]) / len(examples[L])
                                                 for L in lengths},
                              "accuracy": {}, "per_sample": {}}
    for name, model in models.items():
        acc, per = {}, {}
        for L in lengths:
            hits = [score(model, ex, device) for ex in bar(examples[L], desc=f"{name} L={L}", enabled=progress)]
            acc[str(L)] = sum(hits) / len(hits)
            per[str(L)] = [{"depth": round(ex.depth, 4), "correct": h} for ex, h in zip(examples[L], hits)]
        result["accuracy"][name] = acc
        result["per_sample"][name] = per
    return result


def log_accuracy(writer: Any, accuracy: Mapping[str, Mapping[str, float]]) -> None:
    """`run_probe`'s accuracies ({model: {length: accuracy}}) as TensorBoard scalars
    `long_context/<model>/accuracy` over the context length."""
    for name, per_length in accuracy.items():
        for length, value in per_length.items():
            writer.scalar(f"long_context/{name}/accuracy", value, int(length))


@command_line
def main(argv: list[str] | None = None) -> int:
    from megatron_tc.data.bos import bos_record, resolve_bos_id
    from megatron_tc.data.documents import DataError
    from megatron_tc.eval.loading import ModelLoadError, load_model

    p = argparse.ArgumentParser(prog="python -m megatron_tc.eval.long_context",
                                description="Associative-recall probe at several context lengths, teacher vs student")
    p.add_argument("--model", required=True, help="student: HF dir, .gguf or megatron_tc checkpoint")
    p.add_argument("--teacher", help="teacher (scored on the same examples)")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--samples", type=int, default=20, help="examples per length")
    p.add_argument("--method", default="generate", choices=["generate", "rank"])
    p.add_argument("--value-digits", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--tokenizer")
    p.add_argument("--bos", default="auto", choices=("auto", "true", "false"),
                   help="start every prompt with BOS: auto = when the teacher's tokenizer (else the model's) adds BOS")
    p.add_argument("--out", help="write JSON here (e.g. <run_dir>/long_context.json, picked up by report.py)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--tb", default=None, help="TensorBoard log directory: each model's accuracy over the length")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise InputError(f"error: --lengths {args.lengths!r}: give comma-separated token counts, e.g. 1024,4096") from None
    try:
        models = {"student": load_model(args.model, args.device, args.dtype, tokenizer=args.tokenizer)}
        if args.teacher:
            models = {"teacher": load_model(args.teacher, args.device, args.dtype), **models}
        tokenizer = models["student"].tokenizer or models.get("teacher", models["student"]).tokenizer
        teacher_tok = models["teacher"].tokenizer if "teacher" in models else None
        bos_id = resolve_bos_id(teacher_tok or tokenizer, args.bos)
    except (ModelLoadError, DataError) as err:
        raise InputError(f"error: {err}") from None
    examples = make_examples(tokenizer, lengths, args.samples, seed=args.seed, value_digits=args.value_digits,
                             bos_id=bos_id)
    result = run_probe(models, examples, method=args.method, device=args.device, progress=not args.no_progress)
    result.update(model=args.model, teacher=args.teacher, **bos_record(bos_id, args.bos))
    if args.tb:
        from megatron_tc.monitor import TBWriter

        with TBWriter(args.tb) as writer:
            log_accuracy(writer, result["accuracy"])
    text = json.dumps(result, indent=1)
    if args.out:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, args.out)
    print(json.dumps({"accuracy": result["accuracy"], "context_tokens": result["context_tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
