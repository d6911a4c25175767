"""Readout sums: how well a converted layer's recurrence, read through candidate output gates,
explains the teacher's attention output (docs/method.md section 3, "Readout sums").

The student's recurrence runs once per layer and batch with the decay/write gates a strategy
fixed in closed form; each output-gate candidate only changes the elementwise gate after it, so
all candidates are scored from one recurrence. Everything returned is an fp64 sum over tokens.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_tc.model.fused import fused, rms_norm
from megatron_tc.model.gdn import GatedDeltaNet, convolved_heads, decay_and_write
from megatron_tc.model.ops import gated_delta_rule
from megatron_tc.model.ops.gated_delta_rule import PackedRows

from .moments import use_stats_kernel, zero_views

F64 = torch.float64
# value scales c at which sum silu(c v)^2 is recorded ("vgrid"): the authors' output gate needs
# the RMS of SiLU of the value projection after their per-head value scale, clamped to [0.1, 10],
# is folded into it; that scale is known only after the pass, so the sum is interpolated (log-log)
VALUE_SCALE_GRID = torch.logspace(-1.0, 1.0, 81, dtype=F64)


NARROW_DTYPES = (torch.bfloat16, torch.float16)


class WideLinear(nn.Linear):
    """A readout mixer's projection: fp32 output whatever the dtype of its weight (`wide_linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wide_linear(x, self.weight, self.bias)


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias) in fp32 [..., out]. A weight in x's 16-bit dtype multiplies
    there on CUDA with fp32 accumulation and output (a tensor-core GEMM; products of 16-bit
    values are exact in fp32, as in the fp32 GEMM, so only the summation order differs: the fp32
    GEMMs of SmolLM2's q/k/v took 19 ms of sweep 2's 52 ms of device time on an H200);
    otherwise in fp32, operands cast as `.float()` casts them."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in NARROW_DTYPES:
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        out = out.view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.float()
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


# the sums of the candidates' reads mapped through o_proj (the [U; Y] products): only the
# fitted-gate strategies read them, and they are the largest device work and memory of sweep 2
PRODUCT_KEYS = ("G", "r", "YY")
READ_SUM_KEYS = ("uy", "uu", "yy", "beta", "g", "count", "ry", "rr", "vgrid")  # the others, in their order


def empty_readout_sums(
    num_candidates: int, num_heads: int, head_dim: int, device: torch.device | str | None = None,
    products: bool = True,
) -> dict[str, torch.Tensor]:
    """Zero fp64 readout sums of one layer on `device` (the teacher's); without `products`, no
    PRODUCT_KEYS (as `readout_sums` returns them)."""
    return zero_views(readout_sum_shapes(num_candidates, num_heads, products), device)[0]


def readout_sum_shapes(num_candidates: int, num_heads: int, products: bool = True) -> dict[str, tuple[int, ...]]:
    """The shapes of one layer's readout sums (`empty_readout_sums`)."""
    c, h = num_candidates, num_heads
    shapes = {
        "G": (c * h, c * h), "r": (c * h,), "uy": (c, h), "uu": (c, h), "yy": (h,), "YY": (), "beta": (h,),
        "g": (h,), "count": (), "ry": (h,), "rr": (h,), "vgrid": (h, len(VALUE_SCALE_GRID)),
    }
    return {k: shape for k, shape in shapes.items() if products or k not in PRODUCT_KEYS}


@torch.no_grad()
def student_read(mixer: GatedDeltaNet, x: torch.Tensor, doc_ids: torch.Tensor | None):
    """Run the GDN recurrence of `mixer` on x [B, T, hidden]. Returns (o [B, T, H, D] fp32, the
    raw read before o_norm, g [B, T, H], beta [B, T, H])."""
    x = x.to(mixer.q_proj.weight.dtype)  # the converted layer runs in its own dtype (fp32)
    q, k, v = mixer.qkv(x, doc_ids)
    g, beta = mixer.gates(x)
    o, _ = gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta, scale=mixer.head_dim**-0.5, doc_ids=doc_ids,
        use_qk_l2norm=True, chunk_size=mixer.chunk_size, backend="chunk" if not x.is_cuda else "auto",
    )
    return o.float(), g, beta


@torch.no_grad()
def value_silu_grid(mixer: GatedDeltaNet, x: torch.Tensor, max_elements: int | None = None) -> torch.Tensor:
    """[H, C] fp64: per query head, sum over tokens and channels of silu(c v)^2 for every c of
    VALUE_SCALE_GRID, v = v_proj(x) before its activation (k/v heads repeated to query heads).
    fp32 values summed in fp64: on CUDA by `value_grid_triton`, else by `value_grid_reference`
    (`max_elements`: its buffer). `mixer.value_groups` (default 1): consecutive value heads
    whose v_proj rows are the same (the closed form repeated the teacher's k/v heads): the sums
    are made once per group."""
    return layers_value_silu_grid([mixer], [value_inputs(mixer, x)], max_elements)


def value_inputs(mixer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """v_proj(x) [B*T, heads, D] fp32 before its activation, of the first value head of each of
    the `mixer.value_groups` groups of identical heads (`first_value_heads` of the projection)."""
    return first_value_heads(mixer, wide_linear(x, mixer.v_proj.weight, mixer.v_proj.bias))


def first_value_heads(mixer: GatedDeltaNet, values: torch.Tensor) -> torch.Tensor:
    """The first head of each of the `mixer.value_groups` groups of identical value heads of
    values [B, T, kv_heads*D] (the layer's v_proj output): a view [B*T, heads, D], so the
    readout's value grid needs no projection of its own."""
    groups, d = getattr(mixer, "value_groups", 1), mixer.head_dim
    return values.reshape(-1, mixer.kv_heads // groups, groups, d)[:, :, 0]


def layers_value_silu_grid(mixers: Sequence[GatedDeltaNet], values: Sequence[torch.Tensor],
                           max_elements: int | None = None) -> torch.Tensor:
    """`value_silu_grid` of L layers [L*H, C] from their `value_inputs` (same token count), one
    sweep over the scales for all of them."""
    v = concat(values, 1)  # [BT, L*heads, D]
    scales = _value_scales_on(v.device)  # [C, 1, 1, 1]
    if use_stats_kernel(v):  # v read once for all scales (calibrate/value_grid_triton.py)
        from .value_grid_triton import value_grid_sums

        out = value_grid_sums(v, scales)
    else:
        out = value_grid_reference(v, scales, max_elements)
    heads, first = values[0].shape[1], mixers[0]
    group = first.num_heads // heads
    out = out.view(len(values), heads, 1, -1).expand(-1, -1, group, -1)  # k/v heads to query heads
    return out.reshape(len(values) * first.num_heads, -1)


def value_grid_reference(v: torch.Tensor, scales: torch.Tensor, max_elements: int | None = None) -> torch.Tensor:
    """[heads, C] fp64 sums of silu(c v)^2 over tokens and channels for v [BT, heads, D] fp32 and
    scales [C, 1, 1, 1] (the PyTorch reference of `value_grid_triton.value_grid_sums`): several
    scales per kernel, one buffer of at most `max_elements` fp32 values at a time, SiLU and square
    in place, summed in fp64."""
    v = v[None]
    if max_elements is None:  # a GPU wants few large kernels (1 GiB buffers: all 81 scales of a
        # layer's 16k tokens at once); a CPU a buffer that stays in its caches
        max_elements = 2**28 if v.is_cuda else 2**18
    step = max(1, max_elements // v.numel())
    parts = []
    for start in range(0, len(scales), step):
        act = F.silu(scales[start:start + step] * v, inplace=True).square_()  # [c, BT, heads, D]
        parts.append(_sum64(act, (1, 3)))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).t()


_VALUE_SCALES: dict[torch.device, torch.Tensor] = {}


def _value_scales_on(device: torch.device) -> torch.Tensor:
    """VALUE_SCALE_GRID [C, 1, 1, 1] in fp32 on `device`, copied there once (a copy per call would
    wait for the device's queue each time)."""
    if device not in _VALUE_SCALES:
        _VALUE_SCALES[device] = VALUE_SCALE_GRID.to(device=device, dtype=torch.float32).view(-1, 1, 1, 1)
    return _VALUE_SCALES[device]


def concat(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, without a copy of a single tensor (a call of one layer stacks nothing)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=dim)


def _sum64(x: torch.Tensor, dim) -> torch.Tensor:
    """Sum of fp32 `x` over `dim`, accumulated in fp64 without an fp64 copy of `x`."""
    return torch.sum(x, dim=dim, dtype=F64)


def interpolate_value_grid(grid: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sum silu(scale_h v)^2 per head from `grid` [H, C] (value_silu_grid's sums), linear in
    log(sum) against log(scale); scale [H] within the grid's range [0.1, 10]."""
    log_c = VALUE_SCALE_GRID.log().to(grid.device)
    log_s = scale.double().clamp(float(VALUE_SCALE_GRID[0]), float(VALUE_SCALE_GRID[-1])).log()
    right = torch.searchsorted(log_c, log_s).clamp(1, len(log_c) - 1)
    left = right - 1
    w = (log_s - log_c[left]) / (log_c[right] - log_c[left])
    rows = torch.arange(grid.shape[0], device=grid.device)
    lo, hi = grid[rows, left].clamp_min(1e-300).log(), grid[rows, right].clamp_min(1e-300).log()
    return ((1 - w) * lo + w * hi).exp()


@torch.no_grad()
def readout_sums(
    mixer: GatedDeltaNet,
    candidates: list[torch.Tensor | None],
    x: torch.Tensor,
    y: torch.Tensor,
    out: torch.Tensor,
    o_weight: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    products: bool = True,
) -> dict[str, torch.Tensor]:
    """Sums of one layer over one batch.

    mixer: the GDN layer with the strategy's closed-form decay/write gates (its own g_proj and
    o_proj are not used). candidates: g_proj weights [H*D, hidden] of the output-gate candidates,
    None for "no gate" (gate = 1). x [B, T, hidden] teacher mixer input; y [B, H, T, D] teacher
    head outputs before o_proj; out [B, T, hidden] teacher attention output after o_proj;
    o_weight [hidden, H*D] the o_proj the candidates are mapped through. products: also the
    sums after o_proj (PRODUCT_KEYS, `o_proj_products`); without them those keys are absent and
    every other sum is the same, bit for bit.

    Every candidate is handled at once (one gate matmul, one o_proj matmul) and the fp64 sums
    come from three reductions: the kernel count per layer and batch does not grow with the
    candidates. `layers_readout_sums` does the same for several layers at once.
    """
    return layers_readout_sums([mixer], [candidates], [x], [y], [out], [o_weight], doc_ids, products)[0]


def stacked_norm(norms: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Each layer's o_norm (RMSNorm over D) of x [B, T, L, H, D]: the norm's formula with the L
    weights stacked [L, 1, D] (one call, not one per layer)."""
    first = norms[0]
    weight = first.weight if len(norms) == 1 else torch.stack([norm.weight for norm in norms])[:, None]
    return fused("rms_norm", rms_norm, x)(x, weight, first.eps, first.unit_offset)


@torch.no_grad()
def layers_readout_sums(
    mixers: Sequence[GatedDeltaNet],
    candidates: Sequence[list[torch.Tensor | None]],
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    o_weights: Sequence[torch.Tensor],
    doc_ids: torch.Tensor | None = None,
    products: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """`readout_sums` of L layers over the same rows (one entry of each sequence per layer; the
    candidates of every layer alike in count and None-pattern), as one computation from the
    recurrence on: the layers' heads stacked ([B, T, L*H, D]: every sum is per head), so the
    host issues the recurrence, norms and reductions once for all of them. Only the projections
    run per layer. Returns each layer's sums."""
    n, layers = len(candidates[0]), len(mixers)
    first = mixers[0]
    h = first.num_heads
    projections, decays, writes, gates, values = [], [], [], [], []
    for mixer, cands, x in zip(mixers, candidates, xs):
        # one fp32 copy of x for the gates and the output-gate candidates, and for the projections
        # unless their weights are in x's dtype (`wide_linear` then multiplies there)
        wide = x.float()
        projected = x if mixer.q_proj.weight.dtype == x.dtype else wide
        projections.append([getattr(mixer, f"{name}_proj")(projected) for name in "qkv"])
        values.append(first_value_heads(mixer, projections[-1][2]))  # the value grid's input: a view
        decays.append(mixer.a_proj(wide))
        writes.append(mixer.b_proj(wide))
        gates.append(gate_values(wide, cands))
    # the convolutions and gates of every layer at once, their channels and heads side by side
    # (each value is that of the layer's own `qkv` and `gates`): a few calls, not a few per layer
    conv = ([concat([getattr(m, f"{name}_conv1d").weight for m in mixers], 0) for name in "qkv"]
            if first.conv_size > 0 else None)
    raw_doc_ids = doc_ids.doc_ids if isinstance(doc_ids, PackedRows) else doc_ids
    (q, k, v), _ = convolved_heads([concat(parts, 2) for parts in zip(*projections)], conv, first.head_dim,
                                   h // first.kv_heads, raw_doc_ids)  # [B, T, L*H, D]
    g, beta = decay_and_write(concat(decays, 2), concat(writes, 2), concat([m.A_log for m in mixers], 0),
                              concat([m.dt_bias for m in mixers], 0))  # [B, T, L*H]
    raw, _ = gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta, scale=first.head_dim**-0.5, doc_ids=doc_ids,
        use_qk_l2norm=True, chunk_size=first.chunk_size, backend="chunk" if not q.is_cuda else "auto",
    )
    raw = raw.float()
    b, t, _, d = raw.shape
    normed = stacked_norm([mixer.o_norm for mixer in mixers], raw.view(b, t, layers, h, d)).view(b, t, layers * h, d)
    gates = None if gates[0] is None else concat(gates, 3)  # [B, T, C', L*H*D]
    if gates is None and not products and use_stats_kernel(raw):  # every candidate reads `normed`
        from .read_sums_triton import read_sums

        yt = concat([y.transpose(1, 2) for y in ys], 2)  # [B, T, L*H, D] in the teacher's dtype
        uy, ry, yy, uu, rr = read_sums(normed, raw, yt).view(layers, h, 5).unbind(-1)
        with_y = torch.stack([uy] * n + [ry, yy])  # [C + 2, L, H]: u.y per candidate, raw.y, y.y
        squares = torch.stack([uu] * n + [rr])  # u.u per candidate, raw.raw
    else:
        yt = concat([y.float().transpose(1, 2) for y in ys], 2)  # [B, T, L*H, D]
        # [C + 2, B, T, L*H, D]: the gated read of every candidate, the raw read, the teacher's heads
        reads = torch.cat(gated_reads(normed, gates, candidates[0]) + [raw[None], yt[None]])
        # fp32 products summed in fp64 (no fp64 copies of the [C, B, T, H, D] tensors): the sums
        # differ from squaring in fp64 by fp32 rounding of each product (< 1e-7 relative)
        with_y = _sum64(reads * yt, (1, 2, 4)).view(n + 2, layers, h)  # u.y per candidate, raw.y, y.y
        squares = _sum64(reads[:n + 1].square(), (1, 2, 4)).view(n + 1, layers, h)  # u.u per candidate, raw.raw
    beta_sums, g_sums = (_sum64(z.float(), (0, 1)).view(layers, h) for z in (beta, g))
    grids = layers_value_silu_grid(mixers, values).view(layers, h, -1)
    count = torch.full((), float(b * t), dtype=F64, device=q.device)  # a fill, not a host copy
    # each layer's sums as views, one unbind per kind of sum (not an indexing call per layer and sum);
    # the authors' value scale is an OLS fit of the raw read (before o_norm) to y: ry, rr
    per_kind = {"uy": with_y[:n], "uu": squares[:n], "yy": with_y[n + 1], "beta": beta_sums, "g": g_sums,
                "ry": with_y[n], "rr": squares[n], "vgrid": grids}
    views = {key: value.unbind(1 if key in ("uy", "uu") else 0) for key, value in per_kind.items()}
    result = []
    for i in range(layers):
        sums = o_proj_products(reads[:n, :, :, i * h:(i + 1) * h].contiguous(), outs[i], o_weights[i]) if products else {}
        result.append(sums | {key: views[key][i] if key in views else count for key in READ_SUM_KEYS})
    return result


def o_proj_products(gated: torch.Tensor, out: torch.Tensor, o_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"G" [C*H, C*H], "r" [C*H], "YY" []} fp64 for the gated reads u [C, B, T, H, D] fp32 (contiguous)
    mapped through o_proj, U_{c,t,h} = O_h u_{c,t,h}: G = sum U U^T, r = sum U.Y, YY = sum |Y|^2 with
    Y = out [B, T, hidden], o_weight [hidden, H*D]. Candidate-major order (index c*H + h)."""
    n, b, t, h, d = gated.shape
    # U as one batched matmul over heads, [H, C*BT, D] @ [H, D, hidden]; its rows are head-major
    # (h*C + c), the sums' order is candidate-major (c*H + h)
    o_heads = o_weight.float().view(o_weight.shape[0], h, d).permute(1, 2, 0)  # [H, D, hidden]
    hidden = o_weight.shape[0]
    # [U; Y]: U [H*C, BT*hidden] and Y its last row, written in place (no concatenation copy)
    V = torch.empty(h * n + 1, b * t * hidden, dtype=torch.float32, device=gated.device)
    torch.bmm(gated.view(n * b * t, h, d).transpose(0, 1), o_heads, out=V[:h * n].view(h, n * b * t, hidden))
    Y = V[h * n]
    Y.copy_(out.reshape(-1))  # [BT*hidden] fp32
    gram, r = long_products(V, hidden, rows=b)
    if n > 1:
        gram = gram.view(h, n, h, n).permute(1, 0, 3, 2).reshape(n * h, n * h)
        r = r.view(h, n).t().reshape(-1)
    return {"G": gram, "r": r, "YY": _sum64(Y.square(), None)}


PRODUCT_TOKENS = 32  # tokens per fp32 partial product of `long_products`


def long_products(V: torch.Tensor, width: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(U U^T [M, M], U Y [M]) in fp64 for fp32 V = [U; Y] [M + 1, N] (Y its last row) whose
    N = rows * tokens * `width`: fp32 partial products V V^T over blocks of PRODUCT_TOKENS tokens of
    one row (one batched GEMM) summed in fp64. One GEMM over the whole N has an inner size of
    millions, which cuBLAS may run as a GEMV on a few blocks (the replayed pass's profile on an
    H200 showed such GEMVs), and an fp32 accumulation over all of N. Y rides along as a row of
    the same GEMM (no matrix-vector kernel, whose summation order changes with the batch count) and
    blocks never span rows: rows summed in one call or in several make the same fp32 products
    (batches merged by the statistics pass)."""
    m, k = V.shape[0] - 1, PRODUCT_TOKENS * width
    per_row = V.shape[1] // rows
    blocks = per_row // k
    V = V.view(m + 1, rows, per_row)
    full = torch.zeros(m + 1, m + 1, dtype=F64, device=V.device)
    if blocks:
        a = V[:, :, :blocks * k].reshape(m + 1, rows * blocks, k).transpose(0, 1)  # [S, M + 1, K]
        full += torch.bmm(a, a.transpose(1, 2)).sum(0, dtype=F64)
    if per_row > blocks * k:  # each row's tokens after its last whole block
        rest = V[:, :, blocks * k:].transpose(0, 1)  # [rows, M + 1, R]
        full += torch.bmm(rest, rest.transpose(1, 2)).sum(0, dtype=F64)
    return full[:m, :m], full[:m, m]


def gate_values(x: torch.Tensor, candidates: list[torch.Tensor | None]) -> torch.Tensor | None:
    """SiLU(x W_c^T) [B, T, C', H*D] fp32 of the C' candidates with a gate (one matmul over their
    concatenated weights), x [B, T, hidden]; None when no candidate has one."""
    weights = [w.float() for w in candidates if w is not None]
    if not weights:
        return None
    b, t, _ = x.shape
    return F.silu(x.float() @ torch.cat(weights).t()).view(b, t, len(weights), -1)


def gated_reads(normed: torch.Tensor, gates: torch.Tensor | None, candidates: list[torch.Tensor | None]
                ) -> list[torch.Tensor]:
    """The layer output before o_proj through each candidate's output gate, u_c = normed * gate_c
    (None: u_c = normed), in the candidates' order: pieces [c_i, B, T, H, D] whose concatenation
    is [C, B, T, H, D]. normed [B, T, H, D] fp32; gates [B, T, C', H*D] (`gate_values`)."""
    b, t, h, d = normed.shape
    if gates is not None:
        gated = normed[None] * gates.view(b, t, -1, h, d).permute(2, 0, 1, 3, 4)  # [C', B, T, H, D]
    pieces, used = [], 0
    for is_gate, run in itertools.groupby(candidates, key=lambda w: w is not None):
        count = len(list(run))
        if is_gate:
            pieces.append(gated[used:used + count])
            used += count
        else:
            pieces.append(normed[None].expand(count, b, t, h, d))
    return pieces


def solve_joint_scales(G: torch.Tensor, r: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """argmin_a sum_t |sum_i a_i U_i - Y|^2 from G = sum U U^T, r = sum U.Y (fp64), with a ridge
    of `ridge` * mean diagonal so a head whose read is all zero gets scale 0."""
    n = G.shape[0]
    lam = ridge * G.diagonal().mean().clamp_min(1e-30)
    return torch.linalg.solve(G + lam * torch.eye(n, dtype=G.dtype, device=G.device), r)
