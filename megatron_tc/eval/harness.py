"""lm-evaluation-harness (lm-eval 0.4.13) adapter: score any megatron_tc-loadable model on harness tasks.

Importing this module registers the model name ``megatron_tc`` with lm_eval's registry. It accepts
every path `megatron_tc.eval.loading.load_model` accepts (HF teacher, exported student, .gguf,
megatron_tc checkpoint), or an in-memory `LoadedModel` / logits callable plus a tokenizer:

    import megatron_tc.eval.harness  # registers "megatron_tc"
    lm_eval.simple_evaluate(model="megatron_tc", model_args="pretrained=DIR,dtype=bfloat16", tasks=[...])

or from the shell (this module's CLI; lm_eval's own CLI cannot import our registration):

    python -m megatron_tc.eval.harness --model DIR --tasks hellaswag,arc_easy --batch-size 8 --out res.json

Exported students also work with lm_eval's stock HF backend:
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True``.

Scoring matches the harness' HF backend for causal models: context and continuation are encoded
together, the input is truncated from the left to `max_length`, the continuation's log-probabilities
are summed, and `is_greedy` says whether every continuation token is the argmax.
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
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from megatron_tc.eval.loading import LoadedModel, LogitsFn, greedy_generate, load_model, load_tokenizer


@register_model("megatron_tc")
class MegatronTCLM(TemplateLM):
    """A harness LM over a logits callable `forward(input_ids [B, T]) -> logits [B, T, V]`.

    pretrained: a path for `load_model`; or model: a `LoadedModel` / callable (then `tokenizer` is
    required unless the LoadedModel has one). `tokenizer` may be a path or a tokenizer object.
    """

    def __init__(self, pretrained: str | None = None, model: LoadedModel | LogitsFn | None = None,
                 tokenizer: Any = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str = 1, max_length: int = 2048, max_gen_toks: int = 256,
                 add_bos_token: bool = False, **unused: Any) -> None:
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if (pretrained is None) == (model is None):
            raise ValueError("MegatronTCLM needs exactly one of pretrained=PATH or model=<LoadedModel|callable>")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        if pretrained is not None:
            model = load_model(pretrained, device=device, dtype=dtype)
        self._forward: LogitsFn = model.forward if isinstance(model, LoadedModel) else model
        self._generate = model.generate if isinstance(model, LoadedModel) else None
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError("no tokenizer: pass tokenizer=PATH (e.g. the teacher's HF directory)")
        self._device = torch.device(device)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto" -> 1
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)

    # ---- tokenization -----------------------------------------------------------------------
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

    # ---- scoring ----------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """requests: (cache key, context ids, continuation ids) -> (sum log p(continuation), is_greedy)."""
        # longest first, so the padded batches waste little and any out-of-memory happens at once
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            idx = order[start:start + self.batch_size]
            rows = [self._input_row(requests[i][1], requests[i][2]) for i in idx]
            width = max(len(r) for r in rows)
            batch = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for r, row in enumerate(rows):
                batch[r, :len(row)] = torch.tensor(row)  # right padding never affects causal logits
            logprobs = self._forward(batch.to(self._device)).float().log_softmax(-1).cpu()
            for r, i in enumerate(idx):
                key, _, cont = requests[i]
                n_in, n_cont = len(rows[r]), len(cont)
                lp = logprobs[r, n_in - n_cont:n_in]  # positions predicting the continuation
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
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[:-1]  # the last token is predicted, never fed

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood with disjoint windows of max_length (the harness' convention)."""
        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation (the model's cached generate when it has one), cut at the first stop string."""
        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            ids_t = torch.tensor([ids], device=self._device)
            new = (self._generate(ids_t, max_new) if self._generate is not None
                   else greedy_generate(self._forward, ids_t, max_new))
            text = self.tok_decode(new[0].tolist())
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def run_tasks(lm: MegatronTCLM, tasks: list[str], include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, include_defaults: bool = True) -> dict[str, Any]:
    """Run harness tasks on `lm`; returns lm_eval's `results` dict {task: {metric,filter: value}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    return out["results"]


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
    lm = MegatronTCLM(pretrained=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                      batch_size=args.batch_size, max_length=args.max_length)
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
