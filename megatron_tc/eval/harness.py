"""lm-evaluation-harness (lm-eval 0.4.13) on megatron_tc models, through lm_eval's own `HFLM`.

Every model path `megatron_tc.eval.loading` accepts becomes a transformers model object that HFLM
scores and generates with (batched, left-padded generation included): an HF teacher or exported
student directory, a .gguf, or a megatron_tc checkpoint (built in memory as the exported-student
class, `student_model_from_checkpoint`). Importing this module registers the name ``megatron_tc``:

    import megatron_tc.eval.harness  # registers "megatron_tc"
    lm_eval.simple_evaluate(model="megatron_tc", model_args="pretrained=DIR,dtype=bfloat16", tasks=[...])

or from the shell (lm_eval's own CLI cannot import our registration):

    python -m megatron_tc.eval.harness --model DIR --tasks hellaswag,arc_easy --batch-size 8 --out res.json

Exported students also work with lm_eval's stock backend and nothing of megatron_tc:
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True``.

What HFLM cannot do stays here: the BOS rule of the teacher's tokenizer (`adds_bos`), loading
megatron_tc checkpoints, and `LogitsLM`, which scores a bare logits callable (no HF module).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from megatron_tc.config.errors import InputError, command_line
from megatron_tc.eval.loading import LogitsFn, detect_kind, greedy_generate, load_model, load_tokenizer


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts BOS in front of a text by itself: the project's one BOS rule
    (`megatron_tc.data.bos.tokenizer_adds_bos`), so lm-eval scores as `tools/evaluate.py` does."""
    from megatron_tc.data.bos import tokenizer_adds_bos

    return tokenizer_adds_bos(tokenizer)


def load_hf_module(path: str | os.PathLike, device: str | torch.device, dtype: str) -> tuple[torch.nn.Module, Any]:
    """(transformers model object, tokenizer or None) for any model path."""
    kind, directory, _ = detect_kind(path)
    if kind == "megatron_tc":
        from megatron_tc.convert.export import student_model_from_checkpoint

        try:
            tokenizer = load_tokenizer(path)
        except ValueError:
            tokenizer = None
        return student_model_from_checkpoint(directory, dtype).to(device), tokenizer
    loaded = load_model(path, device=device, dtype=dtype)
    return loaded.module, loaded.tokenizer


@register_model("megatron_tc")
class MegatronTCHFLM(HFLM):
    """HFLM over a model path (see the module docstring) or a transformers model object.

    tokenizer: a path or tokenizer object (default: the model's own). add_bos_token: default is
    what the tokenizer does by itself (`adds_bos`)."""

    def __init__(self, pretrained: Any, tokenizer: Any = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str = 1, max_length: int = 2048, add_bos_token: bool | None = None,
                 **kwargs: Any) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        own_tokenizer = None
        if isinstance(pretrained, (str, os.PathLike)):
            pretrained, own_tokenizer = load_hf_module(pretrained, device, dtype)
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        tokenizer = tokenizer if tokenizer is not None else own_tokenizer
        if tokenizer is None:
            raise ValueError("no tokenizer: pass tokenizer=PATH (e.g. the teacher's HF directory)")
        bos = adds_bos(tokenizer) if add_bos_token is None else bool(add_bos_token)
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                         max_length=int(max_length), add_bos_token=bos, device=str(device), **kwargs)


class LogitsLM(TemplateLM):
    """A harness LM over a bare logits callable `forward(input_ids [B, T]) -> logits [B, T, V]`
    (what HFLM cannot take): loglikelihood as HFLM computes it, greedy generation by full forwards."""

    def __init__(self, model: LogitsFn, tokenizer: Any, batch_size: int = 1, max_length: int = 2048,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, device: str = "cpu") -> None:
        super().__init__()
        self._forward, self.tokenizer = model, tokenizer
        self._device = torch.device(device)
        self.batch_size, self.max_length, self.max_gen_toks = int(batch_size), int(max_length), int(max_gen_toks)
        self.add_bos_token = adds_bos(tokenizer) if add_bos_token is None else bool(add_bos_token)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "megatron_tc").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special)["input_ids"]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) -> (sum log p(continuation), is_greedy)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            idx = order[start:start + self.batch_size]
            rows = [self._input_row(requests[i][1], requests[i][2]) for i in idx]
            batch = torch.full((len(rows), max(len(r) for r in rows)), self.eot_token_id, dtype=torch.long)
            for r, row in enumerate(rows):
                batch[r, :len(row)] = torch.tensor(row)  # right padding never affects causal logits
            logprobs = self._forward(batch.to(self._device)).float().log_softmax(-1).cpu()
            for r, i in enumerate(idx):
                key, _, cont = requests[i]
                lp = logprobs[r, len(rows[r]) - len(cont):len(rows[r])]
                target = torch.tensor(cont)
                answer = (float(lp.gather(-1, target[:, None]).sum(dtype=torch.float64)),
                          bool((lp.argmax(-1) == target).all()))
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results  # type: ignore[return-value]

    def _input_row(self, context: list[int], continuation: list[int]) -> list[int]:
        if not continuation:
            raise ValueError("an empty continuation cannot be scored")
        if len(continuation) > self.max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
        return (context + continuation)[-(self.max_length + 1):][:-1]  # the last token is predicted, never fed

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood with disjoint windows of max_length (the harness' convention)."""
        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)]
            total = sum(s for s, _ in self._loglikelihood_tokens([(None, c, x) for c, x in windows], disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy, one request at a time (a logits callable has no cache), cut at the first stop string."""
        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = torch.tensor([self.tok_encode(context)[-(self.max_length - max_new):]], device=self._device)
            text = self.tok_decode(greedy_generate(self._forward, ids, max_new)[0].tolist())
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def run_tasks(lm: TemplateLM, tasks: list[str], include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, include_defaults: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Run harness tasks on `lm`; returns lm_eval's `results` dict {task: {metric,filter: value}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  log_samples=False, bootstrap_iters=0, **kwargs)
    return out["results"]


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_tc.eval.harness",
                                description="lm-evaluation-harness tasks on an HF dir / .gguf / megatron_tc checkpoint")
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", help="directory of extra task YAMLs")
    p.add_argument("--tokenizer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int)
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--out", help="write the results JSON here (atomically)")
    args = p.parse_args(argv)
    from megatron_tc.eval.loading import ModelLoadError

    try:
        lm = MegatronTCHFLM(pretrained=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                            batch_size=args.batch_size, max_length=args.max_length)
    except ModelLoadError as err:
        raise InputError(f"error: --model {args.model}: {err}") from None
    results = run_tasks(lm, args.tasks.split(","), include_path=args.include_path, limit=args.limit,
                        num_fewshot=args.num_fewshot)
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
