"""`model.generate` speed: a teacher on transformers' best path against its exported hybrid student.

Teacher: transformers' LlamaForCausalLM with `cache_implementation="static"` (transformers then
compiles the decoding step). Student: the exported-student class (`MegatronTCForCausalLM`, the code
an export carries) with a quarter of the layers attention, its static cache and captured decoding
step. Same shapes, bf16, random weights (speed does not depend on the values), the same run.

Per model and batch size: one `generate` of `new_tokens` greedy tokens after a prompt of
`prompt` tokens; a logits processor stamps each step (after a device sync, which generate's own
stopping check makes anyway), so prefill (prompt -> first token) and the per-token decoding time
(median step after `warmup_steps`) come from the same call; repeated `repeats` times.

Each case starts from the state a fresh process would have for its shape: transformers sizes a
static cache to the longest `generate` the model has run (`_previous_max_cache_length`, so that its
compiled step is reused), which would make a 4k case after a 32k one attend over 32k slots. The
model forward alone over the prompt (a fresh static cache, the last token's logits: what
`generate` runs for its prefill) is timed too, so generate's own overhead can be told apart from
the model's, and once at a prompt length the process has not run (one token shorter: what a new
prompt length costs before any per-shape planning or tuning is cached); `profile=True` adds the
operators of one such forward (host and device self time).
"""
from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

import torch

from megatron_tc.bench.common import profile_rows, spread, sync
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


def fresh_shape_state(model) -> None:
    """Forget the cache length transformers keeps from earlier `generate` calls (see the module doc)."""
    if "_previous_max_cache_length" in vars(model):
        del model._previous_max_cache_length


def static_cache(model, length: int):
    """The static cache `generate` would build for `length` tokens: the exported student's own
    class, or transformers' StaticCache for a teacher."""
    from transformers import StaticCache

    from megatron_tc.convert.hf_student import MegatronTCCache, MegatronTCForCausalLM

    if isinstance(model, MegatronTCForCausalLM):
        return MegatronTCCache(model.config, static_len=length)
    return StaticCache(config=model.config, max_cache_len=length)


def prefill_forward(model, ids: torch.Tensor, length: int) -> torch.Tensor:
    """One forward over the prompt ids [B, T] into a fresh static cache of `length` slots, the last
    token's logits only: generate's prefill without generate."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                    **{key: static_cache(model, length)})
    return out.logits


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


def time_prefill_forward(model, ids: torch.Tensor, length: int, repeats: int) -> dict[str, float]:
    """Milliseconds of `prefill_forward`, min/median/max over repeats after one warm-up call (with
    repeats=0, the single call itself)."""
    times = []
    for _ in range(repeats + 1):
        sync(ids.device)
        start = time.perf_counter()
        prefill_forward(model, ids, length)
        sync(ids.device)
        times.append(1e3 * (time.perf_counter() - start))
    return spread(times[1:] or times)


def bench_decode(model, kwargs: dict[str, Any], batch: int, prompt: int, new_tokens: int, repeats: int,
                 warmup_steps: int, vocab: int, device: torch.device, profile: bool = False) -> dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    fresh_shape_state(model)
    runs = []
    for _ in range(repeats + 1):  # the first run compiles / captures; not reported
        ids = torch.randint(3, vocab, (batch, prompt), generator=gen).to(device)
        runs.append(one_generate(model, ids, new_tokens, warmup_steps, **kwargs))
    runs = runs[1:]
    decode = spread([r["decode_ms"] for r in runs])
    unseen = ids[:, 1:].contiguous()  # a prompt length this process has not run
    row = {"batch": batch, "prompt": prompt, "decode_ms": decode, "tokens_per_s": 1e3 * batch / decode["median"],
           "prefill_ms": spread([r["prefill_ms"] for r in runs]),
           "prefill_forward_ms": time_prefill_forward(model, ids, prompt + new_tokens, repeats),
           "prefill_new_length_ms": time_prefill_forward(model, unseen, prompt + new_tokens, 0)["median"],
           # generate's prefill of a length new to the process (a student replays its bucket's graph)
           "prefill_new_length_generate_ms": one_generate(model, ids[:, 2:].contiguous(), new_tokens, 0,
                                                          **kwargs)["prefill_ms"],
           "captured_step": getattr(model, "_graph", None) is not None}
    if profile:
        row["prefill_profile"] = profile_rows(lambda: prefill_forward(model, ids, prompt + new_tokens), device)
    return row


OOM_SKIP = ("skipped: this role ran out of memory in an earlier case of this process, after which its compiled "
            "step cannot run again; measure this case in a process of its own (--roles ROLE --batches B)")


def role_rows(arch: ArchConfig, role: str, cases: list[tuple[int, int]], new_tokens: int, repeats: int,
              warmup_steps: int, device: torch.device, dtype: torch.dtype, profile: bool = False):
    """`bench_decode` of one role (teacher, student, or student-eager: the student with no CUDA
    graph, its decoding steps and prefills eager) for each (batch, prompt) of `cases`, a row at a
    time (without model, role). After an out-of-memory error the role's later cases are skipped:
    a compiled step's CUDA-graph pool is unusable after an OOM inside it."""
    model = (teacher_model if role == "teacher" else student_model)(arch, device, dtype)
    if role == "student-eager":
        model.decode_graphs, model.prefill_graph_tokens = False, 0
    out_of_memory = False
    for batch, prompt in cases:
        t0 = time.perf_counter()
        if out_of_memory:
            row = {"batch": batch, "prompt": prompt, "error": OOM_SKIP}
        else:
            try:
                row = bench_decode(model, {"cache_implementation": "static"}, batch, prompt, new_tokens, repeats,
                                   warmup_steps, arch.vocab_size, device, profile)
            except torch.OutOfMemoryError as exc:
                row = {"batch": batch, "prompt": prompt, "error": f"out of memory: {str(exc)[:120]}"}
                out_of_memory = True
                torch.cuda.empty_cache()
        yield row | {"wall_s": round(time.perf_counter() - t0, 1)}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def eager_prefill_rounds(teacher, student, lengths: list[int], rounds: int, extra_slots: int, vocab: int,
                         device: torch.device, profile: bool = False) -> list[dict[str, Any]]:
    """The B=1 prefill forward of a prompt length the student has no whole-model graph for,
    alternating in one process: the teacher (eager); the student eager (its prefill graphs off); the
    student's first prompt of a bucket (its graphs forgotten before each call, so each pays for
    capturing its layer graphs: `LayerGraphs`; their memory pool kept, as a process keeps it after
    its first capture); and the same prompt again over a fresh cache, which
    replays the layer graphs the call before captured (what the captures cost is the difference).
    After two warm-up rounds, `rounds` rounds per prompt length, so that a machine's drift moves all
    alike. Rows {prompt, teacher_ms, student_ms, student_first_ms, student_replay_ms (spreads),
    speedup, speedup_first, speedup_replay (spreads of the per-round teacher ms over the
    student's), rounds}; with `profile`, also {profile: {role: `profile_rows` of one call, operators
    by host time}} for the teacher, the first prompt and the replay (what a first prompt's captures
    cost the host over a replay)."""
    saved = student.prefill_graph_tokens
    gen = torch.Generator(device="cpu").manual_seed(0)

    def with_graphs(forget: bool):
        def timed(ids, length):
            if forget:
                student._prefills.clear()
            student._prefills.counts.clear()  # and a fresh cache: never a whole-model capture
            student.prefill_graph_tokens = saved
            try:
                return time_prefill_forward(student, ids, length, 0)["median"]
            finally:
                student.prefill_graph_tokens = 0
        return timed

    roles = {"teacher": lambda ids, n: time_prefill_forward(teacher, ids, n, 0)["median"],
             "student": lambda ids, n: time_prefill_forward(student, ids, n, 0)["median"],
             "student_first": with_graphs(forget=True), "student_replay": with_graphs(forget=False)}
    rows, prompts = [], []
    student.prefill_graph_tokens = 0
    try:
        for prompt in lengths:
            ids = torch.randint(3, vocab, (1, prompt), generator=gen).to(device)
            times: dict[str, list[float]] = {role: [] for role in roles}
            for warm_up in (True, True, *[False] * rounds):
                for role, timed in roles.items():
                    ms = timed(ids, prompt + extra_slots)
                    if not warm_up:
                        times[role].append(ms)
            speedups = {f"speedup{suffix}": spread([t / s for t, s in zip(times["teacher"], times[role])])
                        for suffix, role in (("", "student"), ("_first", "student_first"),
                                             ("_replay", "student_replay"))}
            rows.append({"prompt": prompt, **{f"{role}_ms": spread(times[role]) for role in roles}, **speedups,
                         "rounds": rounds})
            prompts.append(ids)
        for row, ids in zip(rows if profile else [], prompts):  # after every timing: a capture the
            # profiler breaks turns the layer graphs off, which must not change a timed round
            length = row["prompt"] + extra_slots
            row["profile"] = {role: profile_rows(lambda timed=roles[role]: timed(ids, length), device, by="host")
                              for role in ("teacher", "student_first", "student_replay")}
    finally:
        student.prefill_graph_tokens = saved
    return rows
