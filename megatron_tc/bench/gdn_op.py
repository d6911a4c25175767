"""The Gated DeltaNet op benchmark (tools/bench/gdn.py): fla's chunk kernel, the PyTorch chunked
path and SDPA causal attention, checked against float64 references, then timed forward and
forward+backward over sequence lengths."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from megatron_tc.config.errors import InputError
from megatron_tc.bench.common import Report, measure_peaks, pick_device, rel_err, sync, time_fn
from megatron_tc.model.ops import gated_delta_rule
from megatron_tc.model.ops.gated_delta_rule import fla_available

# Reference timings, one H200, bf16, median of do_bench: (method, H, D, B, T, pass) -> ms
ANCHORS = {
    ("fla", 9, 64, 8, 2048, "fwd+bwd"): 2.92, ("sdpa", 9, 64, 8, 2048, "fwd+bwd"): 0.49,
    ("fla", 9, 64, 1, 32768, "fwd+bwd"): 2.98, ("sdpa", 9, 64, 1, 32768, "fwd+bwd"): 10.06,
    ("fla", 9, 64, 1, 131072, "fwd+bwd"): 11.16, ("sdpa", 9, 64, 1, 131072, "fwd+bwd"): 159.3,
    ("fla", 16, 128, 1, 8192, "fwd"): 0.51, ("sdpa", 16, 128, 1, 8192, "fwd"): 0.52,
    ("fla", 16, 128, 1, 32768, "fwd"): 1.45, ("sdpa", 16, 128, 1, 32768, "fwd"): 7.44,
}
GDN_BACKENDS = {"fla": "fla_chunk", "torch-chunk": "chunk"}


def parse_pairs(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]  # type: ignore[misc]
    except ValueError:
        raise InputError(f"error: expected a comma list like 8x2048,1x8192, got {text!r}") from None


def gdn_inputs(b: int, t: int, h: int, d: int, dtype: torch.dtype, device: torch.device, grad: bool) -> dict:
    """Fresh random GDN inputs; q/k/v in dtype, gates fp32."""
    x = dict(
        q=torch.randn(b, t, h, d, device=device, dtype=dtype), k=torch.randn(b, t, h, d, device=device, dtype=dtype),
        v=torch.randn(b, t, h, d, device=device, dtype=dtype),
        g=F.logsigmoid(torch.randn(b, t, h, device=device)), beta=torch.sigmoid(torch.randn(b, t, h, device=device)),
    )
    return {n: v.requires_grad_(grad) for n, v in x.items()}


def attn_inputs(b: int, t: int, h: int, d: int, dtype: torch.dtype, device: torch.device, grad: bool) -> dict:
    return {n: torch.randn(b, h, t, d, device=device, dtype=dtype).requires_grad_(grad) for n in "qkv"}


def sdpa_context(device: torch.device):
    """Flash attention on CUDA (fails loudly if it cannot run), the default elsewhere."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def run_method(method: str, x: dict, device: torch.device) -> torch.Tensor:
    if method == "sdpa":
        with sdpa_context(device):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)
    o, _ = gated_delta_rule(**x, use_qk_l2norm=True, backend=GDN_BACKENDS[method])
    return o


def check(method: str, h: int, d: int, t: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Largest relative error of output and gradients against float64 at B=2."""
    make = attn_inputs if method == "sdpa" else gdn_inputs
    ref_in = make(2, t, h, d, torch.float64, device, True)
    if method == "sdpa":
        o_ref = F.scaled_dot_product_attention(ref_in["q"], ref_in["k"], ref_in["v"], is_causal=True)
    else:
        o_ref, _ = gated_delta_rule(**ref_in, use_qk_l2norm=True, backend="recurrent")
    do = torch.randn_like(o_ref)
    o_ref.backward(do)
    cast = {n: (v.detach().to(dtype) if n in "qkv" else v.detach().float()).requires_grad_(True)
            for n, v in ref_in.items()}
    o = run_method(method, cast, device)
    o.backward(do.to(o.dtype))
    errors = {"o": rel_err(o, o_ref)}
    errors.update({f"d{n}": rel_err(cast[n].grad, ref_in[n].grad) for n in cast})
    worst = max(errors, key=errors.get)
    return {"method": method, "H": h, "D": d, "T": t, "dtype": str(dtype).replace("torch.", ""),
            "max_rel_err": errors[worst], "worst": worst, **{f"err_{k}": v for k, v in errors.items()}}


def bench_row(method: str, b: int, t: int, h: int, d: int, backward: bool, args, device, dtype) -> dict:
    make = attn_inputs if method == "sdpa" else gdn_inputs
    x = make(b, t, h, d, dtype, device, backward)
    leaves = list(x.values())
    if backward:
        do = torch.randn(b, h, t, d, device=device, dtype=dtype) if method == "sdpa" else torch.randn_like(x["v"])

        def fn():
            run_method(method, x, device).backward(do)
    else:
        def fn():
            with torch.no_grad():
                run_method(method, x, device)
    timing = time_fn(fn, device, budget_ms=args.budget_ms, grad_to_none=leaves if backward else None)
    return timing.as_dict()


def time_shape(h: int, d: int, b: int, t: int, pass_: str, methods: list[str], errors: dict, args, device,
               dtype, report: Report) -> None:
    """One row per method at [b, t] with h heads of d, one pass; then each row's speed-up on SDPA."""
    results: dict[str, float] = {}
    for method in methods:
        row = {"H": h, "D": d, "B": b, "T": t, "pass": pass_, "method": method,
               "max_rel_err": errors.get((method, h, d)), "anchor_ms": ANCHORS.get((method, h, d, b, t, pass_))}
        if method == "torch-chunk" and t > args.chunk_max_t:
            row["note"] = f"skipped: T > --chunk-max-t={args.chunk_max_t} (sequential chunk loop too slow)"
            report.add("rows", row)
            continue
        try:
            row.update(bench_row(method, b, t, h, d, pass_ == "fwd+bwd", args, device, dtype))
            row["Mtok_per_s"] = b * t / (row["ms"] * 1e-3) / 1e6
            results[method] = row["ms"]
        except torch.cuda.OutOfMemoryError as exc:
            row["note"] = "out of memory"
            report.error(f"{method} B={b} T={t} H={h} D={d} {pass_}", exc)
        except Exception as exc:
            row["note"] = f"failed: {type(exc).__name__}"
            report.error(f"{method} B={b} T={t} H={h} D={d} {pass_}", exc)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.add("rows", row)
        print(f"H={h} D={d} B={b} T={t} {pass_:8s} {method:12s} {row.get('ms', float('nan')):10.3f} ms "
              f"{row.get('note', '')}", flush=True)
    # speed-ups against SDPA once all methods of this shape ran
    for row in report.data["rows"][-len(methods):]:
        if "ms" in row and "sdpa" in results:
            row["vs_sdpa"] = results["sdpa"] / row["ms"]


def run(args: Any) -> int:
    """Per head shape of args.heads: the checks, then every shape x pass x method; the report written."""
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    report = Report("gdn", args.out, device, args)
    report.data["peaks"] = measure_peaks(device, quick=args.quick)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "fla" in methods and not (device.type == "cuda" and fla_available()):
        report.note("fla skipped: needs CUDA with flash-linear-attention and triton installed")
        methods.remove("fla")
    passes = [x.strip() for x in args.passes.split(",")]
    errors: dict[tuple[str, int, int], float] = {}
    for h, d in parse_pairs(args.heads):
        for method in methods:
            try:
                row = check(method, h, d, args.check_t, dtype, device)
                errors[(method, h, d)] = row["max_rel_err"]
                report.add("checks", row)
            except Exception as exc:  # keep going: one failing method must not hide the others
                report.error(f"check {method} H={h} D={d}", exc)
            sync(device)
        for b, t in parse_pairs(args.shapes):
            for pass_ in passes:
                time_shape(h, d, b, t, pass_, methods, errors, args, device, dtype, report)
    report.save()
    report.finish([
        ("Correctness (float64 reference, B=2)", "checks", ["method", "H", "D", "T", "dtype", "max_rel_err", "worst"]),
        ("Timings (median ms)", "rows", ["H", "D", "B", "T", "pass", "method", "ms", "Mtok_per_s", "vs_sdpa",
                                         "anchor_ms", "max_rel_err", "note"]),
    ])
    return 0
