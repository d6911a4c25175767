#!/usr/bin/env python
"""Inference: hybrid student (a quarter of the layers attention, `uniform` policy) vs its teacher
(all attention): prefill tokens/s, decode tokens/s at long context, cache memory.

    python tools/bench/inference.py [--out FILE] [--quick] [--models smollm2-135m,llama-1b]
        [--gguf SmolLM2.gguf] [--prefill 4096,32768,131072] [--decode-context 32768]
        [--decode-batches 1,8,32] [--decode-steps 32] [--no-graph] [--roles teacher,student]
        [--sdpa-backend default|flash|cudnn|efficient|math] [--profile-decode]

Both models are `HybridLM` with `HybridCache`, bf16, the GDN layers on fla's kernels (chunked
for prefill, fused recurrent for decoding). Random weights unless --gguf gives the SmolLM2
teacher (speed does not depend on the values). Per model and role:

- check: logits of prefill + 4 cached decoding steps against one full forward (rel. error), with
  the same check in fp32 (PyTorch backends: exact) and the model's bf16-vs-fp32 error beside it;
- prefill: one forward over [1, T] with a cache, hidden states only, LM head on the last token;
- decode at --decode-context: prefill [B, ctx] (not timed), then (a) eager: --decode-steps
  greedy steps through `model(token, cache=cache)`, the project's decoding loop, and (b) graph:
  one decoding step at that context captured in a CUDA graph and replayed (no Python or launch
  overhead: each replay recomputes the same step from the same cache); (c) static graph: a real
  greedy loop of --decode-steps tokens, each a replay of one `StaticDecoder` step captured once
  (megatron_tc/bench/static_decode.py: static KV buffers, device-side length);
- floor: bytes a step must read (weights, KV, 2 x GDN state) over the measured copy bandwidth.
Summary: student/teacher ratios against the goals (decode >= 3x, cache <= 30% of the teacher's).
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.bench.common import (  # noqa: E402
    Report, measure_peaks, model_names, parse_args, pick_device, rel_err, sync, time_fn, time_once,
)  # noqa: E402
from megatron_tc.bench.models import (  # noqa: E402
    PRESETS, cache_bytes, copy_shared_weights, forward_flops, load_gguf_teacher, parameter_bytes, quarter_pattern,
)
from megatron_tc.bench.static_decode import StaticDecoder  # noqa: E402
from megatron_tc.model import HybridCache, HybridLM  # noqa: E402
from megatron_tc.model.cache import AttentionCache, GDNCache  # noqa: E402

DECODE_GOAL, CACHE_GOAL = 3.0, 0.30


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"error: expected a comma list of integers, got {text!r}") from None


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


def bench_role(name, role, model, args, device, peaks, report) -> None:
    arch = model.arch
    base = {"model": name, "role": role, "pattern": arch.layer_pattern,
            "params_M": sum(p.numel() for p in model.parameters()) / 1e6}
    try:
        errs = run_check(model, device, arch.vocab_size, args.check_t)
        report.add("checks", {**base, "check": f"prefill {args.check_t} + 4 cached steps vs full forward", **errs})
    except Exception as exc:
        report.error(f"{name} {role} check", exc)
    for t in ints(args.prefill):
        row = {**base, "T": t}
        try:
            ids = torch.randint(0, arch.vocab_size, (1, t), device=device)
            holder = {}

            def fn():
                holder.clear()  # free the previous call's cache before the next prefill
                holder["out"] = prefill(model, ids, args.prefill_chunk)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timing = time_fn(fn, device, budget_ms=args.budget_ms, max_reps=5)
            row.update(ms=timing.ms, reps=timing.reps, tok_per_s=t / (timing.ms * 1e-3),
                       tflops=forward_flops(arch, t, t) / (timing.ms * 1e-3) / 1e12, **cache_bytes(holder["out"][1]))
            if device.type == "cuda":
                row["peak_mem_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
            holder.clear()
        except Exception as exc:
            row["note"] = f"failed: {type(exc).__name__}"
            report.error(f"{name} {role} prefill T={t}", exc)
        report.add("prefill", row)
        _free(device)
    embed = model.embed_tokens.weight
    # a decoding step reads every weight once, except the embedding table (B rows) unless it is the LM head
    weight_bytes = parameter_bytes(model) - (0 if arch.tie_embeddings else embed.numel() * embed.element_size())
    ctx = args.decode_context
    for b in ints(args.decode_batches):
        row = {**base, "B": b, "context": ctx}
        try:
            ids = torch.randint(0, arch.vocab_size, (b, ctx), device=device)
            logits, cache = prefill(model, ids, args.prefill_chunk)
            del ids
            token = logits[:, -1].argmax(-1, keepdim=True)
            sizes = cache_bytes(cache)
            row.update(sizes)
            decode(model, cache, token, 2)  # warm-up (kernel compilation)
            sync(device)
            total_ms = time_once(lambda: decode(model, cache, token, args.decode_steps), device)
            row["eager_ms"] = total_ms / args.decode_steps
            row["eager_tok_per_s"] = b * 1e3 / row["eager_ms"]
            floor_bytes = weight_bytes + sizes["kv_bytes"] + 2 * sizes["state_bytes"]
            row["floor_ms"] = floor_bytes / (peaks["copy_gbps"] * 1e9) * 1e3
            if args.profile_decode and b == ints(args.decode_batches)[0]:
                prof = profile_decode(model, cache, token, device)
                row.update(launches_per_step=prof["launches_per_step"], aten_calls_per_step=prof["aten_calls_per_step"])
                for entry in prof["top_cpu"]:
                    report.add("decode_profile", {"model": name, "role": role, "B": b, **entry})
            if device.type == "cuda" and not args.no_graph:
                try:
                    row.update(graph_step(model, cache, token, device, args.budget_ms))
                    row["graph_tok_per_s"] = b * 1e3 / row["graph_ms"]
                except Exception as exc:
                    row["note"] = f"graph failed: {type(exc).__name__}"
                    report.error(f"{name} {role} decode graph B={b}", exc)
                try:  # last: it takes a copy of the KV, and the model's cache is freed first
                    static = StaticDecoder(model, cache, capacity=cache.seen_tokens + 2 * args.decode_steps + 4)
                    cache = None
                    row.update(static_graph_decode(static, token, args.decode_steps, device))
                    row["static_graph_tok_per_s"] = b * 1e3 / row["static_graph_ms"]
                    del static
                except Exception as exc:
                    row["note"] = (row.get("note", "") + f" static graph failed: {type(exc).__name__}").strip()
                    report.error(f"{name} {role} decode static graph B={b}", exc)
        except Exception as exc:
            row["note"] = "out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else f"failed: {type(exc).__name__}"
            report.error(f"{name} {role} decode B={b}", exc)
        cache = logits = token = ids = None  # noqa: F841  (free the KV before the next batch size)
        report.add("decode", row)
        print(f"{name} {role} decode B={b}: {row.get('eager_ms')} ms/step eager, {row.get('graph_ms')} graph", flush=True)
        _free(device)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarize(report: Report, name: str) -> None:
    def find(section, role, **match):
        for row in report.data.get(section, []):
            if row["model"] == name and row["role"] == role and all(row.get(k) == v for k, v in match.items()):
                return row
        return {}

    for row in report.data.get("prefill", []):
        if row["model"] == name and row["role"] == "teacher":
            s = find("prefill", "student", T=row["T"])
            if "tok_per_s" in row and "tok_per_s" in s:
                report.add("summary", {"model": name, "metric": f"prefill tok/s T={row['T']}", "teacher": row["tok_per_s"],
                                       "student": s["tok_per_s"], "ratio": s["tok_per_s"] / row["tok_per_s"]})
            if row.get("total_bytes") and s.get("total_bytes"):
                ratio = s["total_bytes"] / row["total_bytes"]
                report.add("summary", {"model": name, "metric": f"cache bytes T={row['T']}", "teacher": row["total_bytes"],
                                       "student": s["total_bytes"], "ratio": ratio, "goal": f"<= {CACHE_GOAL}",
                                       "met": ratio <= CACHE_GOAL})
    for row in report.data.get("decode", []):
        if row["model"] == name and row["role"] == "teacher":
            s = find("decode", "student", B=row["B"])
            for kind in ("eager", "graph", "static_graph"):
                key = f"{kind}_tok_per_s"
                if key in row and key in s:
                    ratio = s[key] / row[key]
                    report.add("summary", {"model": name, "metric": f"decode tok/s ctx={row['context']} B={row['B']} ({kind})",
                                           "teacher": row[key], "student": s[key], "ratio": ratio,
                                           "goal": f">= {DECODE_GOAL}", "met": ratio >= DECODE_GOAL})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--models", default="smollm2-135m,llama-1b", help=f"presets: {', '.join(PRESETS)}")
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF: real teacher weights for smollm2-135m")
    p.add_argument("--prefill", default="4096,32768,131072", help="prefill lengths (batch 1)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of N tokens (0: one pass)")
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-batches", default="1,8,32", help="decode batch sizes (OOM is recorded, not fatal)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--check-t", type=int, default=300)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph decoding step")
    p.add_argument("--roles", default="teacher,student", help="which of teacher,student to run")
    p.add_argument("--sdpa-backend", default="default", choices=("default", "flash", "cudnn", "efficient", "math"),
                   help="restrict torch's SDPA to one backend (torch.nn.attention.sdpa_kernel)")
    p.add_argument("--profile-decode", action="store_true",
                   help="profile 4 eager decoding steps at the first batch size: host time by op, launches per step")
    p.add_argument("--budget-ms", type=float, default=1500.0, help="timed milliseconds per row")
    args = parse_args(p, argv, dict(models="tiny", prefill="64", decode_context=64, decode_batches="1,2",
                                    decode_steps=4, check_t=40, budget_ms=20.0))
    names = model_names(args.models, PRESETS)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    report = Report("inference", args.out, device, args)
    peaks = measure_peaks(device, quick=args.quick)
    report.data["peaks"] = peaks
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if not roles or set(roles) - {"teacher", "student"}:
        raise SystemExit(f"error: --roles takes teacher and/or student, got {args.roles!r}")
    sdpa = nullcontext()
    if args.sdpa_backend != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[args.sdpa_backend])
        report.note(f"SDPA restricted to {args.sdpa_backend}")
    with sdpa:
        for name in names:
            run_model(name, roles, args, device, dtype, peaks, report)
    report.finish([
        ("Checks", "checks", ["model", "role", "check", "rel_err", "rel_err_fp32", "bf16_vs_fp32"]),
        ("Prefill (batch 1)", "prefill", ["model", "role", "T", "ms", "tok_per_s", "tflops", "kv_bytes", "state_bytes",
                                          "peak_mem_GiB", "note"]),
        ("Decode", "decode", ["model", "role", "B", "context", "eager_ms", "eager_tok_per_s", "graph_ms",
                              "graph_tok_per_s", "static_eager_ms", "static_graph_ms", "static_graph_tok_per_s",
                              "floor_ms", "total_bytes", "graph_vs_eager_err", "launches_per_step",
                              "aten_calls_per_step", "note"]),
        ("Decode profile: host time by op (eager step)", "decode_profile",
         ["model", "role", "B", "op", "calls_per_step", "self_cpu_ms_per_step"]),
        ("Student vs teacher", "summary", ["model", "metric", "teacher", "student", "ratio", "goal", "met"]),
    ])
    return 0


def run_model(name: str, roles: list[str], args, device, dtype, peaks, report: Report) -> None:
    """Teacher and/or student of one preset: build, bench, free; then the student/teacher summary."""
    arch = PRESETS[name]()
    teacher_cpu = None
    if args.gguf and name == "smollm2-135m":
        teacher_cpu, _ = load_gguf_teacher(args.gguf)
        arch = teacher_cpu.arch
        report.note(f"{name}: weights from {args.gguf}")
    patterns = {"teacher": "A" * arch.num_layers, "student": quarter_pattern(arch.num_layers)}
    for role in roles:
        try:
            model = build(arch, patterns[role], device, dtype, teacher_cpu)
        except Exception as exc:
            report.error(f"{name} {role} build", exc)
            continue
        bench_role(name, role, model, args, device, peaks, report)
        del model
        _free(device)
    summarize(report, name)


if __name__ == "__main__":
    sys.exit(main())
