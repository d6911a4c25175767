"""Per-layer Taylor statistics of one softmax attention layer, as fp64 sums over query tokens.

Pure math on tensors (no model, no process groups): `attention_sums` takes what the teacher's
attention computed for one batch and returns sums whose division by the token counts gives the
statistics of docs/method.md section 3. Attention logits are formed one chunk of queries at a time
against the keys that chunk can see (causal: keys < chunk end; sliding: the last window), with the
model's masks (`model.ops.attention_mask`), so memory is B*H*chunk*T, never B*H*T*T; every
statistic of a chunk comes from one logits tensor in a few passes (batched row dot products as
matmuls), with the distribution's log taken from the logits, never as log(probabilities).

Two paths produce the same per-query-row statistics (CLOSED_ROW_KEYS + the attention output y):
the PyTorch chunks above (`_chunk_rows`, closed by `close_rows`; CPU, fallback, reference) and, on
CUDA with triton, a fused flash-attention-style kernel (`moments_triton.attention_closed`: one
pass over the visible keys, no logits in memory, the rows closed in the same program). Either's
rows are summed per head in fp64. $MEGATRON_TC_STATS_KERNEL picks: auto (default), triton,
reference.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from megatron_tc.model.ops import attention_mask, positions_from_doc_ids

F64 = torch.float64

# Which count divides each per-head sum (docs/method.md section 3).
DENOMINATOR = {
    "dist": "count", "entropy": "count", "sink": "count", "logit_var": "count",
    "out_energy": "count", "out_energy_o": "count", "zero_order_err": "count",
    "dist_nosink": "count2", "conc": "count2", "conc_nosink": "count3",
    # the authors' closed form (strategy_paper.Taylor): attention on the query's own key (their distance
    # counts it as 0.5) and the mean over tokens of each head output's RMS over its channels
    "self": "count", "y_rms": "count",
}
HEAD_KEYS = tuple(DENOMINATOR) + ("y_sum", "y_sq")
KV_HEAD_KEYS = ("k_sum", "k_sq", "v_sum", "v_sq")
LAYER_KEYS = ("count", "count2", "count3", "x_sum", "x_energy", "resid_energy", "Y_energy")


def layer_sum_shapes(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The shape of each of one layer's sums (`attention_sums` + `layer_input_sums`)."""
    h, kv, d = num_heads, num_kv_heads, head_dim
    shapes: dict[str, tuple[int, ...]] = {key: (h,) for key in DENOMINATOR}
    shapes.update(y_sum=(h, d), y_sq=(h, d, d), k_sum=(kv, d), k_sq=(kv, d, d), v_sum=(kv, d), v_sq=(kv, d, d),
                  x_sum=(hidden,))
    shapes.update({key: () for key in ("count", "count2", "count3", "x_energy", "resid_energy", "Y_energy")})
    return shapes


def empty_layer_sums(
    num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, device: torch.device | str | None = None,
    layers: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """Zero fp64 sums of `layers` layers with the shapes `attention_sums` adds into, on `device`
    (the teacher's, so per-batch results are added where they are computed): views of one buffer
    (one fill, not one per sum)."""
    return zero_views(layer_sum_shapes(num_heads, num_kv_heads, head_dim, hidden), device, layers)


def zero_views(shapes: dict[str, tuple[int, ...]], device: torch.device | str | None = None, copies: int = 1
               ) -> list[dict[str, torch.Tensor]]:
    """`copies` dicts of zero fp64 tensors of `shapes`, all views of one buffer (one fill)."""
    templates = _shape_templates(tuple(shapes.values()))
    flat = torch.zeros(copies, sum(t.numel() for t in templates), dtype=F64, device=device)
    # torch's C++ unflatten: the views without a Python call each (a pass makes thousands)
    return [dict(zip(shapes, _unflatten_dense_tensors(row, templates))) for row in flat.unbind(0)]


@functools.lru_cache(maxsize=64)
def _shape_templates(shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """Storage-less tensors of `shapes` (what `_unflatten_dense_tensors` reads of them)."""
    return [torch.empty(shape, dtype=F64, device="meta") for shape in shapes]


def _sink_index(doc_ids: torch.Tensor | None, b: int, t: int, device: torch.device) -> torch.Tensor:
    """[B, T] sequence index of the first token of each token's document."""
    index = torch.arange(t, device=device).expand(b, t)
    if doc_ids is None:
        return torch.zeros_like(index)
    return index - positions_from_doc_ids(doc_ids)


STATS_KERNEL_ENV = "MEGATRON_TC_STATS_KERNEL"  # auto (CUDA + triton), triton, reference
CLOSE_ROWS = 8192  # queries closed at once (bounds the [B, H, rows, D] fp32 temporaries)
ROW_KEYS = ("m", "z_rest", "ent_sum", "dist_sum", "n", "var", "s_sink")
# what `close_rows` sums per head, in its order (the Triton kernel's closed planes)
CLOSED_ROW_KEYS = ("dist", "entropy", "sink", "logit_var", "zero_order_err", "dist_nosink", "conc", "conc_nosink",
                   "self")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_stats_kernel(q: torch.Tensor) -> bool:
    """Whether the statistics pass takes its fused Triton kernels for q (sweep 1's
    `moments_triton`, sweep 2's value grid `value_grid_triton`): with
    $MEGATRON_TC_STATS_KERNEL=auto (default) when q is on CUDA and triton imports; `triton`
    forces them (on CPU: under TRITON_INTERPRET=1), `reference` forces the PyTorch paths."""
    mode = os.environ.get(STATS_KERNEL_ENV, "auto")
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"${STATS_KERNEL_ENV}={mode!r}: use auto, triton or reference")
    if mode == "triton" and not _triton_importable():
        raise ImportError(f"${STATS_KERNEL_ENV}=triton needs the triton package; unset it to use the PyTorch path")
    return mode == "triton" or (mode == "auto" and q.is_cuda and _triton_importable())


def documents_are_contiguous(doc_ids: torch.Tensor) -> bool:
    """Whether every run of equal ids in doc_ids [B, T] is a distinct document (no id returns
    later in its row), as packing writes them: then "same id and causal" is "from the run's first
    token on", the kernel's mask. One host sync per new tensor (the layers of a batch share it)."""
    last = _CONTIGUOUS_CACHE.get("last")
    if last is not None and last[0] is doc_ids and last[1] == doc_ids._version:
        return last[2]
    runs = (doc_ids[:, 1:] != doc_ids[:, :-1]).sum(1)
    ordered = doc_ids.sort(dim=1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    result = bool((runs == distinct).all())
    _CONTIGUOUS_CACHE["last"] = (doc_ids, doc_ids._version, result)
    return result


_CONTIGUOUS_CACHE: dict[str, tuple[torch.Tensor, int, bool]] = {}


NEG = -1e30  # masked logits: exp() is exactly 0, and 0 * NEG is 0 (not NaN as with -inf)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a[..., j] * b[..., j] for a, b [B, H, c, Tk] (one contraction, no product tensor)."""
    return torch.einsum("bhct,bhct->bhc", a, b)


def _rowdot_shared(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j p[b, h, i, j] * w[i, j] for p [B, H, c, Tk], w [c, Tk]."""
    return torch.einsum("bhct,ct->bhc", p, w)


def _chunk_rows(
    s: torch.Tensor, mask: torch.Tensor, dist: torch.Tensor, sink: torch.Tensor, v: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-query-row statistics of one chunk from its logits, in a few passes (the PyTorch
    reference of `moments_triton.attention_closed`'s walk over the keys).

    s [B, H, c, Tk] fp32 logits (overwritten), mask [B, 1, c, Tk] bool, dist [c, Tk] query-key
    distance, sink [B, c] position of each query's sink among the Tk keys (-1: not among them),
    v [B, Hkv, Tk, D] fp32. Returns ({key: [B, H or 1, c]} for ROW_KEYS, y_ns [B, H, c, D]):
    m the largest visible non-sink logit, z_rest = sum e, ent_sum = sum e s0, dist_sum = sum e d
    with s0 = s - m (0 where masked or at the sink) and e = exp(s0); n the visible keys, var the
    logit variance over them (sink included), s_sink the sink's logit (NEG when hidden), y_ns the
    output of the sink-free distribution e / z_rest.
    """
    b, h, c, tk = s.shape
    hkv = v.shape[1]
    has_sink = (sink >= 0)[:, None, :, None].expand(b, h, c, 1)
    at = sink.clamp_min(0)[:, None, :, None].expand(b, h, c, 1)
    s.masked_fill_(~mask, NEG)
    s_at = s.gather(-1, at)
    s.scatter_(-1, at, torch.where(has_sink, NEG, s_at))  # the sink's logit out of the row
    s_sink = torch.where(has_sink, s_at, NEG)  # NEG when hidden (window) or not among the keys
    m = s.amax(-1, keepdim=True)
    m = torch.where(m > NEG / 2, m, s_sink)  # a query whose only visible key is its sink
    s.sub_(m)
    e = s.exp()  # 0 where masked and at the sink
    s.masked_fill_(~mask, 0.0).scatter_(-1, at, torch.where(has_sink, 0.0, s.gather(-1, at)))  # s0
    z_rest = e.sum(-1)
    y_ns = (e.view(b, hkv, -1, tk) @ v).view(b, h, c, -1) / torch.where(z_rest > 0, z_rest, 1.0)[..., None]
    n = mask.sum(-1, dtype=torch.float32)  # [B, 1, c] visible keys
    # logit variance over the visible keys, from the logits shifted by m (the sink's is l_sink)
    l_sink = (s_sink - m).squeeze(-1)
    seen = (s_sink.squeeze(-1) > NEG / 2).float()
    mean_s = (s.sum(-1) + seen * l_sink) / n
    var_s = (_rowdot(s, s).double() + (seen * l_sink).double().pow(2)) / n - mean_s.double().pow(2)
    rows = {
        "m": m.squeeze(-1), "z_rest": z_rest, "ent_sum": _rowdot(e, s), "dist_sum": _rowdot_shared(e, dist),
        "n": n, "var": var_s.float(), "s_sink": s_sink.squeeze(-1),
    }
    return rows, y_ns


def close_rows(
    rows: dict[str, torch.Tensor], y_ns: torch.Tensor, v_sink: torch.Tensor, d_sink: torch.Tensor,
    vbar: torch.Tensor, s_self: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-head fp64 sums over the queries of a slice from their per-row statistics (the PyTorch
    chunks' close; the Triton kernel runs the same per-row formulas in `moments_triton._close_rows`).

    rows {key: [B, H or 1, c]} (ROW_KEYS, see `_chunk_rows`), y_ns [B, H, c, D], v_sink
    [B, Hkv, c, D] the value at each query's sink, d_sink [B, 1, c] the distance to it, vbar
    [B, Hkv, c, D] the mean visible value (the zero-order term), s_self [B, H, c] each query's
    logit on its own key (gives the "self" sum). Returns (sums [H] of CLOSED_ROW_KEYS, y [B, H, c, D]).

    The sink-free distribution q = e / z_rest is exactly representable however much mass the
    sink holds (in fp32, its p would underflow): entropy_ns = log z_rest - sum q s0 and
    dist_ns = sum q d (no cancellation); the full distribution follows from the sink's share
    p_sink = sigmoid(l_sink - log z_rest), l_sink = s_sink - m.
    """
    b, h, c, d = y_ns.shape
    hkv = v_sink.shape[1]
    s_sink, z_rest, n = rows["s_sink"], rows["z_rest"], rows["n"]
    m = torch.where(rows["m"] > NEG / 2, rows["m"], s_sink)
    l_sink = s_sink - m
    log_rest = z_rest.log()  # -inf when only the sink is visible
    log_z = torch.logaddexp(log_rest, l_sink)  # log sum over all visible keys (shifted by m)
    p_sink = (l_sink - log_z).exp()
    z_ns = (log_rest - log_z).exp()  # non-sink mass, without cancellation
    ok = z_rest > 0
    z_safe = torch.where(ok, z_rest, 1.0)
    dist_ns = rows["dist_sum"] / z_safe
    ent_ns = z_safe.log() - rows["ent_sum"] / z_safe
    y = (z_ns[..., None] * y_ns).view(b, hkv, h // hkv, c, d) + p_sink.view(b, hkv, -1, c, 1) * v_sink[:, :, None]
    zero_err = (y - vbar[:, :, None]).pow(2).sum(-1).view(b, h, c)
    ent = z_ns * ent_ns - torch.special.xlogy(z_ns, z_ns) - torch.special.xlogy(p_sink, p_sink)
    n_ns = n - (s_sink > NEG / 2).float()
    has2 = n >= 2
    per_row = {  # [B, H, c] fp32 each; masked rows are zeroed before the sum
        "dist": z_ns * dist_ns + p_sink * d_sink, "entropy": ent, "sink": p_sink,
        "logit_var": rows["var"].clamp_min(0), "zero_order_err": zero_err,
        "dist_nosink": torch.where(has2 & ok, dist_ns, 0.0),
        "conc": torch.where(has2, 1 - ent / torch.log(n.clamp_min(2)), 0.0),
        "conc_nosink": torch.where((n_ns >= 2) & ok, 1 - ent_ns / torch.log(n_ns.clamp_min(2)), 0.0),
    }
    if s_self is not None:  # p_self = exp(s_self - m - log_z): the own key is always visible
        per_row["self"] = (s_self - m - log_z).exp()
    # one fp64-accumulated reduction for every statistic (each is one kernel otherwise)
    stacked = torch.stack([x.expand(b, h, c) for x in per_row.values()])  # [K, B, H, c]
    totals = torch.sum(stacked, dim=(1, 3), dtype=F64)  # [K, H]
    return dict(zip(per_row, totals.unbind(0))), y.view(b, h, c, d)


def running_mean_values(v: torch.Tensor, lo: torch.Tensor, v64: torch.Tensor | None = None) -> torch.Tensor:
    """vbar [B, H, T, D] fp32: mean of v [B, H, T, D] over the visible keys lo[b, t]..t (an fp64
    cumsum; v64: v in fp64 when the caller has it)."""
    b, h, t, d = v.shape
    csum = (v.to(F64) if v64 is None else v64).cumsum(dim=2)  # [B, H, T, D]: sum over 0..t
    index = torch.arange(t, device=v.device)
    below = csum.gather(2, (lo - 1).clamp_min(0)[:, None, :, None].expand(-1, h, -1, d))  # sum over 0..lo-1
    below.masked_fill_((lo == 0)[:, None, :, None], 0.0)
    count = (index[None] - lo + 1).to(F64)[:, None, :, None]
    return csum.sub_(below).div_(count).float()


def attention_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    o_weight: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    chunk_size: int = 128,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-head and per-KV-head sums of one attention layer over a batch.

    q [B, Hq, T, D], k/v [B, Hkv, T, D]: what the teacher's softmax sees (after q/k norm and
    RoPE); o_weight [hidden, Hq*D] the layer's o_proj weight (its head columns); doc_ids [B, T].
    Returns (sums, y) with y [B, Hq, T, D] the per-head attention outputs (before o_proj).
    Layer-level keys (count, x_*, resid_energy, Y_energy) are added by `layer_input_sums`.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hkv})")
    sink_index = _sink_index(doc_ids, b, t, q.device)
    k_index = torch.arange(t, device=q.device)
    lo = sink_index if sliding_window is None else torch.maximum(sink_index, k_index[None] - sliding_window + 1)
    kernel = use_stats_kernel(q)
    if kernel and doc_ids is not None and not documents_are_contiguous(doc_ids):
        if os.environ.get(STATS_KERNEL_ENV) == "triton":
            raise ValueError("the stats kernel needs each document id in one contiguous run per row (as packing "
                             f"writes them); unset ${STATS_KERNEL_ENV} to use the PyTorch path for these doc_ids")
        kernel = False  # an id that returns later in a row: the PyTorch chunks mask by id equality
    kv64 = torch.cat([k, v], 1).to(F64)  # [B, 2 Hkv, T, D]: the running means' and the moments' input
    if kernel:
        from .moments_triton import attention_closed

        kbar, vbar = running_mean_values(kv64, lo, kv64).chunk(2, dim=1)  # [B, Hkv, T, D]
        rows, y = attention_closed(q, k, v, scale, lo, sink_index, kbar, vbar)  # closed in the kernel
        stacked = torch.stack([rows[key] for key in CLOSED_ROW_KEYS])  # [K, B, H, T]
        sums = dict(zip(CLOSED_ROW_KEYS, torch.sum(stacked, dim=(1, 3), dtype=F64).unbind(0)))
    else:
        vbar = running_mean_values(v, lo, kv64[:, hkv:])  # [B, Hkv, T, D]
        sums, y = _reference_sums(q, k, v, scale, doc_ids, sliding_window, chunk_size, sink_index, vbar)
    energy = torch.linalg.vector_norm(y, dim=-1, dtype=F64).square()  # [B, H, T] |y_t|^2, no fp64 copy of y
    sums["out_energy"] = energy.sum(dim=(0, 2))
    sums["y_rms"] = energy.div(d).sqrt().sum(dim=(0, 2))
    sums["y_sum"], sums["y_sq"] = _first_moments(y.to(F64))
    # sum_t |O_h y_t|^2 = <O_h^T O_h, sum_t y_t y_t^T>: from y_sq, exact in fp64, no [B, H, T, hidden]
    o_heads = o_weight.to(F64).view(o_weight.shape[0], hq * d).t().view(hq, d, -1)  # [H, D, hidden]
    gram = o_heads @ o_heads.transpose(1, 2)  # O_h^T O_h [H, D, D]
    sums["out_energy_o"] = (gram * sums["y_sq"]).sum(dim=(1, 2))
    kv_sum, kv_sq = _first_moments(kv64)  # [2 Hkv, D], [2 Hkv, D, D]
    sums["k_sum"], sums["v_sum"] = kv_sum.chunk(2)
    sums["k_sq"], sums["v_sq"] = kv_sq.chunk(2)
    return sums, y


def split_layers(sums: dict[str, torch.Tensor], layers: int) -> list[dict[str, torch.Tensor]]:
    """The sums of `attention_sums` over several layers' heads stacked (q [B, L*Hq, T, D], k/v
    [B, L*Hkv, T, D], o_weight [hidden, L*Hq*D]: every statistic is per head, so stacking layers
    is stacking heads) as one dict per layer (views of the leading head dimension)."""
    parts = {key: value.chunk(layers) for key, value in sums.items()}
    return [{key: chunks[i] for key, chunks in parts.items()} for i in range(layers)]


def _first_moments(x64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t x_t [H, D], sum_t x_t x_t^T [H, D, D]) over the batch and tokens of fp64 x [B, H, T, D]."""
    sq = (x64.transpose(-1, -2) @ x64).sum(dim=0)  # [H, D, D]
    return x64.sum(dim=(0, 2)), sq


def _reference_sums(q, k, v, scale, doc_ids, sliding_window, chunk_size, sink_index, vbar):
    """`close_rows` sums [H] over the PyTorch chunks' rows, and y [B, Hq, T, D] (the kernel-free
    path of `attention_sums`)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    vf = v.float()
    v_sink = vf.gather(2, sink_index[:, None, :, None].expand(b, hkv, t, d))  # [B, Hkv, T, D]
    d_sink = (torch.arange(t, device=q.device)[None] - sink_index).float()[:, None]  # [B, 1, T]
    qf = q.float().view(b, hkv, hq // hkv, t, d)
    s_self = (qf * scale * k.float()[:, :, None]).sum(-1).view(b, hq, t)
    sums: dict[str, torch.Tensor] = {}  # the first slice's sums, then added into
    ys = []
    for rows, y_ns, span in _reference_rows(q, k, vf, scale, doc_ids, sliding_window, chunk_size, sink_index):
        for start in range(0, y_ns.shape[2], CLOSE_ROWS):  # bounded fp32 temporaries per slice
            part = slice(start, start + CLOSE_ROWS)
            at = slice(span.start + start, min(span.start + start + CLOSE_ROWS, span.stop))
            chunk, y = close_rows({key: r[:, :, part] for key, r in rows.items()}, y_ns[:, :, part],
                                  v_sink[:, :, at], d_sink[..., at], vbar[:, :, at], s_self[:, :, at])
            if sums:
                add_into(sums, chunk)
            else:
                sums = chunk
            ys.append(y)
    return sums, ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)


def _reference_rows(q, k, vf, scale, doc_ids, sliding_window, chunk_size, sink_index):
    """Yields (rows, y_ns, slice of queries) chunk by chunk of queries (see `_chunk_rows`): logits
    against the keys a chunk can see (causal: keys < chunk end; sliding: the last window)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    k_index = torch.arange(t, device=q.device)
    kf_t = k.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, T]
    for start in range(0, t, chunk_size):
        stop = min(start + chunk_size, t)
        k_lo = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        q_index, keys = k_index[start:stop], k_index[k_lo:stop]
        qc = q[:, :, start:stop].float().mul(scale).view(b, hkv, hq // hkv, stop - start, d)
        logits = (qc @ kf_t[..., k_lo:stop]).view(b, hq, stop - start, stop - k_lo)
        doc_q = doc_ids[:, start:stop] if doc_ids is not None else None
        doc_k = doc_ids[:, k_lo:stop] if doc_ids is not None else None
        mask = attention_mask(q_index, keys, sliding_window, doc_q, doc_k).expand(b, 1, -1, -1)
        dist = (q_index[:, None] - keys[None, :]).clamp_min(0).float()
        sink = sink_index[:, start:stop] - k_lo  # < 0: the sink is outside this chunk's keys
        sink = torch.where(sink >= 0, sink, -1)
        rows, y_ns = _chunk_rows(logits, mask, dist, sink, vf[:, :, k_lo:stop])
        yield rows, y_ns, slice(start, stop)


def layer_input_sums(
    x: torch.Tensor, resid: torch.Tensor, out: torch.Tensor, doc_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> dict[str, torch.Tensor]:
    """Layer-level sums: token counts, mixer input x [B, T, hidden] (after input_norm), residual
    stream `resid` entering the layer, mixer output `out` (attention after o_proj)."""
    return layers_input_sums([x], [resid], [out], doc_ids, sliding_window)[0]


def layers_input_sums(
    xs: Sequence[torch.Tensor], resids: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
    doc_ids: torch.Tensor | None = None, sliding_window: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """`layer_input_sums` of L layers over the same rows (lists of L tensors [B, T, hidden]): a
    reduction per kind of tensor for all layers, fp64 sums with no fp64 copy of the inputs (a
    reduction casts as it reads)."""
    b, t, _ = xs[0].shape
    n, sink_seen = _visible_keys(b, t, doc_ids, sliding_window, xs[0].device)
    counts = torch.stack([n >= 2, (n - sink_seen.long()) >= 2]).sum(dim=(1, 2), dtype=F64)
    count = torch.full((), float(b * t), dtype=F64, device=xs[0].device)  # a fill, not a host copy
    # |.|^2 as a 2-norm in fp64, squared (a batched dot product here ran as a cuBLAS GEMV: 4.7 ms
    # per layer for 8k tokens of SmolLM2 on an H200)
    stacked = [torch.stack(list(group)) for group in (xs, resids, outs)]  # 3 x [L, B, T, hidden]
    energies = [torch.linalg.vector_norm(group.flatten(1), dim=1, dtype=F64).square() for group in stacked]
    x_sums = stacked[0].flatten(1, 2).sum(dim=1, dtype=F64)  # [L, hidden]
    per_layer = zip(x_sums.unbind(0), *(energy.unbind(0) for energy in energies))  # views, one call per kind
    return [{"count": count, "count2": counts[0], "count3": counts[1], "x_sum": x_sum,
             "x_energy": x_energy, "resid_energy": resid_energy, "Y_energy": out_energy}
            for x_sum, x_energy, resid_energy, out_energy in per_layer]


def _visible_keys(b: int, t: int, doc_ids: torch.Tensor | None, window: int | None, device):
    """([B, T] number of keys each query sees (same document, causal, sliding window),
    [B, T] bool: whether the document's first token is among them)."""
    pos = positions_from_doc_ids(doc_ids) if doc_ids is not None else torch.arange(t, device=device).expand(b, t)
    n = pos + 1
    if window is None:
        return n, torch.ones_like(n, dtype=torch.bool)
    return n.clamp(max=window), pos < window


def add_into(total: dict, part: dict) -> None:
    """total[key] += part[key] for every key of `part` (tensors), as one multi-tensor add (same devices and dtypes)."""
    keys = list(part)
    torch._foreach_add_([total[key] for key in keys], [part[key] for key in keys])
