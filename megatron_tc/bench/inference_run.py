"""Inference benchmark (tools/bench/inference.py): the hybrid student against its teacher per
preset and role, prefill, decode (eager, CUDA graph, static graph) and cache bytes, and the
student/teacher summary against the goals (decode >= 3x, cache <= 30% of the teacher's)."""
from __future__ import annotations

import argparse
import gc
from contextlib import nullcontext

import torch

from megatron_tc.config.errors import InputError
from megatron_tc.bench.common import Report, measure_peaks, model_names, pick_device, sync, time_fn, time_once
from megatron_tc.bench.inference import (build, decode, graph_step, prefill, profile_decode, run_check,
                                         static_graph_decode)
from megatron_tc.bench.models import (PRESETS, cache_bytes, forward_flops, load_gguf_teacher, parameter_bytes,
                                      quarter_pattern)
from megatron_tc.bench.static_decode import StaticDecoder

DECODE_GOAL, CACHE_GOAL = 3.0, 0.30


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise InputError(f"error: expected a comma list of integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Every preset of --models and role of --roles; writes the report (JSON + Markdown)."""
    names = model_names(args.models, PRESETS)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    report = Report("inference", args.out, device, args)
    peaks = measure_peaks(device, quick=args.quick)
    report.data["peaks"] = peaks
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if not roles or set(roles) - {"teacher", "student"}:
        raise InputError(f"error: --roles takes teacher and/or student, got {args.roles!r}")
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
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
            row["note"] = "out of memory" if oom else f"failed: {type(exc).__name__}"
            report.error(f"{name} {role} decode B={b}", exc)
        cache = logits = token = ids = None  # noqa: F841  (free the KV before the next batch size)
        report.add("decode", row)
        print(f"{name} {role} decode B={b}: {row.get('eager_ms')} ms/step eager, {row.get('graph_ms')} graph",
              flush=True)
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
                report.add("summary", {"model": name, "metric": f"prefill tok/s T={row['T']}",
                                       "teacher": row["tok_per_s"], "student": s["tok_per_s"],
                                       "ratio": s["tok_per_s"] / row["tok_per_s"]})
            if row.get("total_bytes") and s.get("total_bytes"):
                ratio = s["total_bytes"] / row["total_bytes"]
                report.add("summary", {"model": name, "metric": f"cache bytes T={row['T']}",
                                       "teacher": row["total_bytes"], "student": s["total_bytes"], "ratio": ratio,
                                       "goal": f"<= {CACHE_GOAL}",
                                       "met": ratio <= CACHE_GOAL})
    for row in report.data.get("decode", []):
        if row["model"] == name and row["role"] == "teacher":
            s = find("decode", "student", B=row["B"])
            for kind in ("eager", "graph", "static_graph"):
                key = f"{kind}_tok_per_s"
                if key in row and key in s:
                    ratio = s[key] / row[key]
                    metric = f"decode tok/s ctx={row['context']} B={row['B']} ({kind})"
                    report.add("summary", {"model": name, "metric": metric,
                                           "teacher": row[key], "student": s[key], "ratio": ratio,
                                           "goal": f">= {DECODE_GOAL}", "met": ratio >= DECODE_GOAL})


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
