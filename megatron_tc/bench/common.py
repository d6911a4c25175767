"""Timing, error metrics, device ceilings and result files shared by tools/bench/*.py.

Timing: a warm-up call first (kernel compilation and
autotuning stay out of the numbers), then the median of repeated calls timed on the device.
Short functions go through `triton.testing.do_bench` (CUDA events, L2 flushed between calls);
long ones (a second or more per call) through CUDA events around each call, a few repeats.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd import DeviceType

from megatron_tc.config.errors import InputError


# ---- devices and timing ----------------------------------------------------------------------
def pick_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("error: --device cuda asked for but torch.cuda.is_available() is False")
    return torch.device(name)


def spread(values: list[float]) -> dict[str, float]:
    """{min, median, max} of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _do_bench() -> Callable | None:
    try:
        from triton.testing import do_bench
    except Exception:  # triton missing (CPU machines) or broken
        return None
    return do_bench


@dataclass
class Timing:
    ms: float  # median milliseconds per call
    reps: int  # timed calls (do_bench: its own count, reported as -1)
    method: str  # "do_bench" | "events" | "wall"
    first_ms: float  # the first call (warm-up: includes compilation/autotuning)

    def as_dict(self) -> dict[str, Any]:
        return {"ms": round(self.ms, 4), "reps": self.reps, "timer": self.method,
                "first_call_ms": round(self.first_ms, 1)}


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events around it on CUDA, wall clock after a sync elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    return (time.perf_counter() - start_s) * 1e3


def time_fn(
    fn: Callable[[], Any],
    device: torch.device,
    budget_ms: float = 500.0,
    max_reps: int = 100,
    grad_to_none: list[torch.Tensor] | None = None,
) -> Timing:
    """Median milliseconds of `fn()` after one warm-up call.

    budget_ms bounds the timed part; at least one timed call is always made. On CUDA, functions
    shorter than budget_ms / 10 use do_bench (median, L2 flushed between calls); longer ones are
    timed call by call with CUDA events (the call after the warm-up counts as the first sample).
    On CPU, wall clock around each call.
    """
    sync(device)
    first = time_once(fn, device)
    estimate = time_once(fn, device)
    do_bench = _do_bench() if device.type == "cuda" else None
    if do_bench is not None and estimate * 10 < budget_ms:
        try:
            ms = do_bench(fn, warmup=min(25.0, budget_ms / 4), rep=budget_ms, grad_to_none=grad_to_none,
                          return_mode="median")
            return Timing(float(ms), -1, "do_bench", first)
        except TypeError:  # an older do_bench without return_mode
            pass
    times = [estimate]
    for _ in range(int(min(max_reps, budget_ms // max(estimate, 1e-3))) - 1):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        times.append(time_once(fn, device))
    return Timing(statistics.median(times), len(times), "events" if device.type == "cuda" else "wall", first)


def parse_args(parser, argv: list[str] | None, quick_defaults: dict[str, Any]):
    """Parse argv; with --quick, `quick_defaults` replace the defaults (explicit flags still win)."""
    known, _ = parser.parse_known_args(argv)
    if getattr(known, "quick", False):
        parser.set_defaults(**quick_defaults)
    return parser.parse_args(argv)


def model_names(text: str, presets: dict) -> list[str]:
    """Comma list of preset names, checked before any work starts."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in presets]
    if unknown or not names:
        raise InputError(f"error: unknown model preset {unknown[0] if unknown else text!r}; "
                         f"choose from {', '.join(presets)}")
    return names


# ---- errors --------------------------------------------------------------------------------
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds NaN/inf (NaN never passes)."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


# ---- device ceilings -------------------------------------------------------------------------
def measure_peaks(device: torch.device, quick: bool = False) -> dict[str, float]:
    """Measured bf16 matmul rate (TFLOP/s; fp32 on CPU) and device copy bandwidth (GB/s,
    bytes read + written), random data (never zeros)."""
    n = 256 if quick else (8192 if device.type == "cuda" else 1024)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = time_fn(lambda: a @ b, device, budget_ms=50 if quick else 300)
    numel = (1 << 16) if quick else ((1 << 29) if device.type == "cuda" else (1 << 24))  # 1 GiB bf16 on CUDA
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    cp = time_fn(lambda: dst.copy_(src), device, budget_ms=50 if quick else 300)
    return {
        "matmul_tflops": 2 * n**3 / (mm.ms * 1e-3) / 1e12,
        "matmul_size": n,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "copy_gbps": 2 * src.numel() * src.element_size() / (cp.ms * 1e-3) / 1e9,
    }


# ---- environment and results ---------------------------------------------------------------------
def profile_rows(fn: Callable[[], Any], device: torch.device, top: int = 12, by: str = "device",
                 ranges: str = "") -> list[dict[str, Any]]:
    """One warm call of `fn` under torch.profiler: a row with the host and device self time of all
    operators (the device time of each kernel counted once, with the operator that launched it), on
    CUDA a `device_busy_row`, then the `top` operators and kernels by device time (host time on
    CPU; by="host": by host time, the CUDA runtime's calls such as graph instantiation among them).
    Host time well above device time means the host (launches, Python) is the bound, not the
    kernels. ranges: also a row per `record_function` range whose name starts with it
    (`range_rows`: the host time inside it, all it called included, and the device time of what it
    launched), after the operators and not among them."""
    if by not in ("device", "host"):
        raise ValueError(f"profile_rows orders by 'device' or 'host' time, not {by!r}")
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    device_us = lambda e: getattr(e, "self_device_time_total", 0.0) if cuda else 0.0  # noqa: E731
    on_host = [e for e in events if e.device_type == DeviceType.CPU]  # a kernel's own entry would count it twice
    rows = [{"op": "(all)", "calls": sum(e.count for e in events),
             "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
             "device_ms": sum(device_us(e) for e in on_host) / 1e3}]
    busy = device_busy_row(prof) if cuda else None
    rows += [busy] if busy else []
    order = (lambda e: (device_us(e), e.self_cpu_time_total)) if by == "device" else (lambda e: e.self_cpu_time_total)
    in_range = (lambda e: e.key.startswith(ranges)) if ranges else (lambda e: False)  # noqa: E731
    for e in sorted((e for e in events if not in_range(e)), key=order, reverse=True)[:top]:
        rows.append({"op": e.key[:70], "calls": e.count, "host_ms": e.self_cpu_time_total / 1e3,
                     "device_ms": device_us(e) / 1e3})
    return rows + range_rows(prof, ranges) if ranges else rows


def range_rows(prof, prefix: str) -> list[dict[str, Any]]:
    """{"range", calls, host_ms, device_ms} of each host-side `record_function` range of `prof`
    whose name starts with `prefix`, by name: the host time inside it and the device time of the
    kernels its operators launched (0 off CUDA; the range's own device-side copy is not counted)."""
    spans: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith(prefix) and e.device_type == DeviceType.CPU:
            span = spans.setdefault(e.name, [0, 0.0, 0.0])
            span[0], span[1], span[2] = span[0] + 1, span[1] + e.cpu_time_total, span[2] + _launched_us(e)
    return [{"range": name, "calls": calls, "host_ms": host / 1e3, "device_ms": device / 1e3}
            for name, (calls, host, device) in sorted(spans.items())]


def _launched_us(event) -> float:
    """Device time (us) of the kernels launched by `event` and the operators under it."""
    own = sum(kernel.duration for kernel in getattr(event, "kernels", None) or [])
    return own + sum(_launched_us(child) for child in event.cpu_children)


def device_busy_row(prof) -> dict[str, Any] | None:
    """{"op": "(device busy)", host_ms: the profiled call's wall time, device_ms: the time at least
    one kernel or copy ran}: a device busy for a small part of the wall time waits for its host.
    None without device events (off CUDA)."""
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    if not spans:
        return None
    first = min(e.time_range.start for e in events)
    last = max(e.time_range.end for e in events)
    return {"op": "(device busy)", "calls": len(spans), "host_ms": (last - first) / 1e3,
            "device_ms": covered(spans) / 1e3}


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals (start, end) (overlapping ones counted once)."""
    total, start, end = 0.0, None, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (0.0 if end is None else end - start)


def host_syncs(fn: Callable[[], Any], device: torch.device, top: int = 3) -> dict[str, Any]:
    """One warm call of `fn` with CUDA's sync debug mode on: how many times the host waited for
    the device (`item()`, a copy to the host, a plain copy from pageable memory, `nonzero`, ...) and
    the Python lines that waited most. {} off CUDA."""
    if device.type != "cuda":
        return {}
    import warnings
    from collections import Counter

    fn()
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"host_syncs": sum(sites.values()),
            "where": "; ".join(f"{site} x{count}" for site, count in sites.most_common(top))}


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and machine, recorded with every result file."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "device": str(device), "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu_threads"] = torch.get_num_threads()
    from importlib import metadata

    for key, dist in (("triton", "triton"), ("fla", "flash-linear-attention"), ("deepspeed", "deepspeed"),
                      ("tilelang", "tilelang")):
        try:  # metadata only: importing deepspeed alone takes seconds
            info[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[key] = None
    return info


def default_out(name: str) -> Path:
    """runs/bench/bench_<name>.json, or under $MEGATRON_TC_BENCH_DIR when that is set."""
    base = Path(os.environ.get("MEGATRON_TC_BENCH_DIR") or Path("runs") / "bench")
    return base / f"bench_{name}.json"


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


class Report:
    """Rows of one benchmark, written (atomically) to JSON after every row, so a run killed at
    its time limit still leaves what it measured; `finish()` prints the markdown tables."""

    def __init__(self, name: str, out: str | os.PathLike | None, device: torch.device, args: Any = None):
        self.name = name
        self.path = Path(out) if out else default_out(name)
        self.data: dict[str, Any] = {"benchmark": name, "env": environment(device), "args": vars(args) if args else {},
                                     "rows": [], "checks": [], "notes": [], "errors": []}

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.data.setdefault(section, []).append(row)
        self.save()

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.add("notes", text)

    def error(self, where: str, exc: BaseException) -> None:
        text = f"{where}: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"ERROR {text}", flush=True)
        self.add("errors", text)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are read by others (and come back from the device)
        os.replace(tmp, self.path)

    def finish(self, tables: list[tuple[str, str, list[str]]]) -> str:
        """tables: (title, section, columns). Prints and writes <out>.md; returns the text."""
        parts = [f"## {self.name} ({self.data['env'].get('gpu', self.data['env']['device'])}, "
                 f"{self.data['env']['date']})", f"`{self.data['env']['command']}`"]
        for title, section, columns in tables:
            rows = self.data.get(section, [])
            if rows:
                parts += [f"### {title}", markdown_table(rows, columns)]
        for key in ("notes", "errors"):
            if self.data[key]:
                parts.append(f"**{key}:**\n" + "\n".join(f"- {x}" for x in self.data[key]))
        text = "\n\n".join(parts) + "\n"
        print(text, flush=True)
        md = self.path.with_suffix(".md")
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
        self.save()
        return text
