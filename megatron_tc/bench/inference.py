"""Inference benchmark's measurements (tools/bench/inference.py): prefill with a cache, greedy
decoding, a decoding step captured in a CUDA graph, a `StaticDecoder` loop replayed per token,
host time by op under torch.profiler, and the cached-vs-full-forward logits check."""
from __future__ import annotations

import copy

import torch

from megatron_tc.bench.common import rel_err, sync, time_fn, time_once
from megatron_tc.bench.models import copy_shared_weights
from megatron_tc.bench.static_decode import StaticDecoder
from megatron_tc.model import HybridCache, HybridLM
from megatron_tc.model.cache import AttentionCache, GDNCache


@torch.no_grad()
def prefill(model: HybridLM, ids: torch.Tensor, chunk: int = 0) -> tuple[torch.Tensor, HybridCache]:
    """ids [B, T] -> (logits of the last position [B, 1, V], filled cache); optionally in chunks."""
    cache = HybridCache(model.arch)
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        hidden = model(ids[:, start:start + step], cache=cache, return_hidden=True)
    return model.logits(hidden[:, -1:]), cache


@torch.no_grad()
def decode(model: HybridLM, cache: HybridCache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding: token [B, 1] -> the last token after `steps` steps."""
    for _ in range(steps):
        token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
    return token


def snapshot(cache: HybridCache) -> list:
    state = [cache.seen_tokens]
    for e in cache.layers:
        if isinstance(e, AttentionCache):
            state.append(e.snapshot())
        elif isinstance(e, GDNCache):
            state.append((e.state, dict(e.conv), e.seen))
        else:
            state.append(None)
    return state


def restore(cache: HybridCache, state: list) -> None:
    """Undo decoding steps: GDN tensors are replaced, never written in place, by a step; attention
    KV is written in place where no query from the snapshot on reads (AttentionCache.snapshot)."""
    cache.seen_tokens = state[0]
    for e, s in zip(cache.layers, state[1:]):
        if isinstance(e, AttentionCache):
            e.restore(s)
        elif isinstance(e, GDNCache):
            e.state, e.conv, e.seen = s[0], dict(s[1]), s[2]


@torch.no_grad()
def profile_decode(model: HybridLM, cache: HybridCache, token: torch.Tensor, device, steps: int = 4,
                   rows: int = 15) -> dict:
    """Eager decoding steps under torch.profiler: host time per step by op (self CPU time, the
    eager loop's cost) and kernel launches per step. The steps are undone afterwards."""
    from torch.profiler import ProfilerActivity, profile

    saved = snapshot(cache)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        decode(model, cache, token, steps)
        sync(device)
    restore(cache, saved)
    events = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC"))
    return {"launches_per_step": launches / steps,
            "aten_calls_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
            "top_cpu": [{"op": e.key[:80], "calls_per_step": e.count / steps,
                         "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in top]}


def graph_step(model: HybridLM, cache: HybridCache, token: torch.Tensor, device, budget_ms: float) -> dict:
    """One decoding step at the cache's context, captured in a CUDA graph; median replay time and
    the replay's logits against an eager step's (rel. error)."""
    saved = snapshot(cache)
    static = token.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(2):
            eager = model(static, cache=cache)
            restore(cache, saved)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = model(static, cache=cache)
    finally:
        restore(cache, saved)
    graph.replay()
    sync(device)
    err = rel_err(out, eager)
    timing = time_fn(graph.replay, device, budget_ms=budget_ms)
    del graph, out
    return {"graph_ms": timing.ms, "graph_vs_eager_err": err}


@torch.no_grad()
def static_graph_decode(static: StaticDecoder, token: torch.Tensor, steps: int, device) -> dict:
    """A greedy loop of `steps` tokens replaying one captured `StaticDecoder` step per token (the
    token fed in, the argmax read out): ms per step, after 2 replayed warm-up steps. First the same
    loop without the graph (static_eager_ms): the host cost of the step without SDPA and the
    model's cache bookkeeping, to compare with the model's eager loop."""
    token = static.decode(token, 2)[:, -1:]
    sync(device)
    eager = time_once(lambda: static.decode(token, steps), device)
    static.capture()
    token = static.decode(token, 2)[:, -1:]
    sync(device)
    total = time_once(lambda: static.decode(token, steps), device)
    return {"static_eager_ms": eager / steps, "static_graph_ms": total / steps}


def build(arch, pattern: str, device, dtype, teacher_cpu) -> HybridLM:
    with torch.device(device):
        model = HybridLM(arch.with_pattern(pattern))
    if teacher_cpu is not None:
        copy_shared_weights(teacher_cpu, model)
    return model.to(dtype=dtype).eval()


def _cached_vs_full(model: HybridLM, ids: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of prefill t + 3 cached steps [1, 4, V], the same 4 positions of one full forward)."""
    with torch.no_grad():
        full = model(ids)[:, -5:-1]
        logits, cache = prefill(model, ids[:, :t])
        steps = [logits]
        for i in range(3):
            steps.append(model(ids[:, t + i:t + i + 1], cache=cache))
    return torch.cat(steps, dim=1), full


def run_check(model: HybridLM, device, vocab: int, t: int) -> dict:
    """Prefill t tokens + 4 cached steps vs one forward over t + 4 tokens (last 4 logits), in the
    model's dtype (fla kernels on CUDA), and the two references that say what that error means:

    rel_err_fp32: the same check on an fp32 copy with the PyTorch chunked GDN backend for prefill
        and steps (exact math: ~1e-6 unless the cache itself is wrong);
    bf16_vs_fp32: the model's full forward against the fp32 copy's (its own precision; a random
        hybrid student amplifies bf16 rounding ~10x more than its all-attention teacher, so a
        larger rel_err for the student is expected as long as it stays well below this)."""
    ids = torch.randint(0, vocab, (1, t + 4), device=device)
    cached, full = _cached_vs_full(model, ids, t)
    row = {"rel_err": rel_err(cached, full)}
    ref = copy.deepcopy(model).float()
    ref.set_gdn_backend("chunk")
    cached32, full32 = _cached_vs_full(ref, ids, t)
    row.update(rel_err_fp32=rel_err(cached32, full32), bf16_vs_fp32=rel_err(full, full32))
    del ref
    return row
