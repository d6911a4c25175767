"""Workers for tests/gpu/test_parallel_nccl.py: the parallel parity checks of tests/parallel, on
CUDA over NCCL (one GPU per rank), in fp32 and bf16.

Every check compares the parallel run with the same run on one GPU (same weights, same data):
- fp32 (TF32 off): directly, with tight relative tolerances (below);
- TP forward/backward, fp32 and bf16: against an fp64 run on the GPU by `assert_as_accurate`:
  rel(parallel, fp64) <= ratio x rel(one GPU, fp64) + floor (ratio 2; 3 for bf16 TP, see TP_RATIO).
  A sharding bug makes the parallel run far worse than the one-GPU run of the same precision.
- bf16 training (PP, ZeRO-3): the fp64 rule above too, but bf16 AdamW trajectories are 30-80% off
  fp64 (early lr * sign(g) steps flip with gradient noise), so that only catches gross failures;
  the sharp check is `assert_like_other_order`: the parallel run may differ from the one-GPU run by
  at most 2x (TP: 3x) what the one-GPU run differs from itself with each step's micro-batches merged
  into one (a legitimate change of reduction order), plus a floor.
The GDN op is the pure-PyTorch 'chunk' kernel (`place`): fla compiles for about a minute per shape
and is tested against it in tests/gpu/test_fla_parity.py.
"""
from __future__ import annotations

import os

import torch

from megatron_tc.parallel import pipeline as pipe
from megatron_tc.parallel.state import destroy_parallel, init_parallel
from tests.parallel import _workers_pipeline as wpp
from tests.parallel import _workers_tp as wtp
from tests.parallel import _workers_zero as wz
from tests.parallel._workers_common import VOCAB, assert_as_accurate, assert_close, batches, rel_err

DTYPES = (torch.float32, torch.bfloat16)
# fp32 on GPU, parallel vs one GPU. TP splits every GEMM, so cuBLAS reduces in another order:
# twice the CPU tolerance (1e-5). PP and DP run the very same GEMM shapes as one GPU: the CPU
# tolerances (step losses 1e-5; weights after 5 AdamW steps 1e-5 together, 1e-4 per tensor).
TP_FP32_TOL = 2e-5
# bf16 TP may be up to 3x (not 2x) as far from fp64 as one GPU: a row-parallel layer rounds each
# rank's partial sum to bf16 and the all-reduce adds them in bf16 (one GPU rounds once, after an
# fp32 accumulation), and replicated gradients (norm weights) are summed in bf16 too. Measured on
# CPU-gloo with these workers: TP/one-GPU error ratio 1.05 on logits, 1.4-1.9 on all gradients.
# A sharding bug gives errors of order 1 (>10x the one-GPU bf16 error of ~3e-2 here).
TP_RATIO = 3.0
# Per-tensor floors of the 2x rule (whole-vector checks use _workers_common.FLOOR): small tensors (A_log, norm
# weights, biases) have few elements to average rounding over.
TENSOR_FLOOR = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# A tensor of a few elements (A_log, dt_bias: one per head) averages nothing: in bf16 its gradient is
# a sum over every token with cancellation, and the two runs' roundings land where they land. On two
# H200s, TP=2's A_log gradient (4 heads) was 0.177 from fp64 where one GPU's was 0.0517
# (ratio 3.4; on CPU-gloo below 2). Bugs stay visible above this floor: a missing reduction halves a
# gradient (error 0.5), a head swap or wrong sign gives 1-2.
SMALL_TENSOR, SMALL_TENSOR_FLOOR_BF16 = 16, 0.2


def tensor_floor(t: torch.Tensor, dtype: torch.dtype) -> float:
    """The floor of the per-tensor `assert_as_accurate` checks for a tensor like `t`."""
    if dtype == torch.bfloat16 and t.numel() <= SMALL_TENSOR:
        return SMALL_TENSOR_FLOOR_BF16
    return TENSOR_FLOOR[dtype]


def exact_numerics(device: str) -> None:
    """fp32 parity needs true fp32 GEMMs and convolutions (TF32 would round inputs to 10 bits)."""
    if device == "cpu":  # the workers also run on CPU/gloo (a dry run of this suite's logic)
        return
    # Deterministic kernels where torch has them (cuBLAS needs its workspace setting before the first
    # GEMM): the same one-GPU fp32 run gave different losses on GPU 0 and GPU 1
    # (1.34e-6 vs 5.74e-7 from fp64), and the reference must not move between runs.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Triton kernels (fla's, if a test uses them) multiply fp32 in TF32 unless told otherwise; fla's
    # own fp32 tests set this too. (It did not change PP=2's fp32 difference: see _pp2_fp32_like_one_gpu.)
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    # The element-wise blocks run eagerly (model/fused.py): their compiled kernels are specialized per
    # shape, so TP's halved head counts would compare two different fusions, and compiling them
    # costs about a minute per test; the fusion has its own test (tests/gpu/test_fused_model_cuda.py).
    os.environ["MEGATRON_TC_COMPILE"] = "0"
    torch.use_deterministic_algorithms(True, warn_only=True)
    # bf16 GEMMs accumulate in fp32 throughout: cuBLAS may otherwise reduce split-K partial sums in
    # bf16, with splits chosen per shape, so TP's halved GEMMs would round differently by design
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.cuda.manual_seed_all(0)


def _cat(tensors: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([tensors[n].detach().double().flatten() for n in names])


def _fp32_same_weights(got: dict, want: dict, exact: dict, what: str, tol_all: float, tol_each: float) -> None:
    """fp32 weights after AdamW steps: all together within `tol_all` of the one-GPU run; each tensor
    within `tol_each`, or else no farther from the fp64 run than 2x the one-GPU run (+1e-4). A
    tensor that starts at zero (b_proj.bias) holds nothing but Adam updates, and Adam turns
    reduction-order rounding of near-zero gradients into +-lr flips: measured 2.03e-4 on it for
    TP=2 x DP=2 on CPU, while its one-GPU fp32 run is as far from fp64."""
    names = sorted(want)
    assert sorted(got) == names, f"{what}: different tensor names"
    err = rel_err(_cat(got, names), _cat(want, names))
    assert err <= tol_all, f"{what}: all tensors together, relative error {err:.3g} > {tol_all:g}"
    for n in names:
        if rel_err(got[n], want[n]) > tol_each:
            assert_as_accurate(got[n], want[n], exact[n], f"{what}: {n} (differs from one GPU by "
                               f"{rel_err(got[n], want[n]):.3g} > {tol_each:g})", torch.float32,
                               TENSOR_FLOOR[torch.float32])


def _updates_as_accurate(got: dict, single: dict, exact: dict, init: dict, init_exact: dict, what: str,
                         dtype: torch.dtype, ratio: float = 2.0) -> None:
    """bf16: the weight *changes* of training (final - initial), parallel vs one GPU vs fp64: the
    check on the updates is ~10x more sensitive than on the weights (which mostly are the init).
    (fp32 weights are compared with the one-GPU run directly, which is stronger: AdamW turns
    rounding noise of near-zero gradients into +-lr update flips, so an fp32 ratio test on
    updates would measure those flips rather than parallelism.)
    The bf16 one-GPU updates are themselves 30-80% off the fp64 ones (measured on CPU): bf16
    gradient noise flips AdamW's early lr * sign(g) steps. So this check only catches gross
    failures (lost or doubled data, unsynchronized replicas); the fp32 checks carry exactness.
    Per tensor the ratio is 3: few elements, so the ratio of two noise-dominated errors spreads
    (worst measured on CPU 1.2-1.8)."""
    if dtype != torch.bfloat16:
        return
    names = sorted(got)
    delta = {n: got[n].double() - init[n].double() for n in names}
    delta_1 = {n: single[n].double() - init[n].double() for n in names}
    delta_x = {n: exact[n].double() - init_exact[n].double() for n in names}
    total = assert_as_accurate(_cat(delta, names), _cat(delta_1, names), _cat(delta_x, names), f"{what} all updates",
                               dtype, ratio=ratio)
    worst = max(assert_as_accurate(delta[n], delta_1[n], delta_x[n], f"{what} update of {n}", dtype,
                                   tensor_floor(delta[n], dtype), ratio=3.0) for n in names)
    print(f"{what} {dtype}: update error ratio parallel / one GPU (vs fp64): all {total:.2f}, worst tensor "
          f"{worst:.2f}; one-GPU update error {rel_err(_cat(delta_1, names), _cat(delta_x, names)):.2e}", flush=True)


# Measured with these workers on CPU-gloo, bf16, parallel difference / merged-micro-batch spread:
# ZeRO-3 DP=2 losses 0.71, updates 1.03; PP=2 0.0 (bit-identical) and 0.60 / 0.52; TP=2 x DP=2
# 1.52 / 2.18 (TP adds bf16 partial-sum roundings: ratio TP_RATIO there). A deliberately wrong
# learning rate (1.5e-3 instead of 2e-3) in the ZeRO-3 run gives 2.91 / 1.61: caught on the losses.
LOSS_FLOOR = 1e-3


def merged(data: list) -> list:
    """The same steps with each step's micro-batches joined into one (same global batch, same loss:
    every micro-batch has the same number of tokens): gradients are then summed inside the GEMMs
    instead of across micro-batches in bf16, a legitimate change of reduction order. (Reversing
    the order would be no perturbation at all for two micro-batches: a + b == b + a.)"""
    return [[tuple(torch.cat(parts) for parts in zip(*step))] for step in data]


def assert_like_other_order(got: torch.Tensor, single: torch.Tensor, single_other_order: torch.Tensor, what: str,
                           ratio: float = 2.0, floor: float = 1e-3) -> float:
    """bf16 training (and fp32 through fla's kernels): the parallel run may differ from the one-GPU
    run by no more than `ratio` x as much as the one-GPU run differs from itself when each step's
    micro-batches are merged into one
    (`merged`: the legitimate rounding difference of another reduction order), plus a
    floor. Much sharper than the fp64 comparison: another reduction order moves bf16 gradients by ~1 ulp,
    not by the 5-10% by which bf16 gradients are off fp64. Returns the ratio (for logs)."""
    err, spread = rel_err(got, single), rel_err(single_other_order, single)
    assert err <= ratio * spread + floor, (f"{what}: parallel vs one GPU {err:.3g} > {ratio:g} x "
                                           f"(one GPU vs itself with micro-batches merged) {spread:.3g} + {floor:g}")
    return err / spread if spread else 0.0


def _deltas(state: dict, init: dict, names) -> torch.Tensor:
    return torch.cat([(state[n].double() - init[n].double()).flatten() for n in names])


# ---- TP = 2 -------------------------------------------------------------------------------------
def tp2_matches_one_gpu(rank: int, world_size: int, device: str = "cuda") -> None:
    """Logits and the gradient of every parameter, both variants of tests/parallel/_workers_tp."""
    exact_numerics(device)
    ctx = init_parallel(tp=2, pp=1)
    try:
        assert ctx.tp_size == 2 and (device == "cpu" or torch.cuda.current_device() == rank)
        for variant in wtp.VARIANTS:
            exact = wtp.tp_and_single_forward_backward(variant, ctx, torch.float64, device)
            assert exact["logits"].device.type == device
            # fp64 (GDN gates and output norm stay fp32 islands, and cuBLAS may pick other kernels for
            # the halved batched GEMMs there): 1e-6 on logits (CPU: 1e-7), 1e-5 per gradient (as CPU)
            assert_close(exact["tp_logits"], exact["logits"], f"{variant} fp64 logits", 1e-6)
            for name, want in exact["grads"].items():
                assert_close(exact["tp_grads"][name], want, f"{variant} fp64 grad of {name}", 1e-5)
            for dtype in DTYPES:
                out = wtp.tp_and_single_forward_backward(variant, ctx, dtype, device)
                what = f"{variant} {dtype}"
                tp_all, one_all, exact_all = (wtp.all_grads(out["tp_grads"]), wtp.all_grads(out["grads"]),
                                              wtp.all_grads(exact["grads"]))
                if dtype == torch.float32:
                    assert_close(out["tp_logits"], out["logits"], f"{what} logits", TP_FP32_TOL)
                    assert_close(tp_all, one_all, f"{what} all gradients", TP_FP32_TOL)
                assert_as_accurate(out["tp_logits"], out["logits"], exact["logits"], f"{what} logits", dtype,
                                   ratio=TP_RATIO)
                assert_as_accurate(tp_all, one_all, exact_all, f"{what} all gradients", dtype, ratio=TP_RATIO)
                worst = max(assert_as_accurate(out["tp_grads"][name], want, exact["grads"][name],
                                               f"{what} grad of {name}", dtype, tensor_floor(want, dtype), TP_RATIO)
                            for name, want in out["grads"].items())
                print(f"rank {rank} TP=2 {what}: logits err vs fp64 {rel_err(out['tp_logits'], exact['logits']):.2e} "
                      f"(1 GPU {rel_err(out['logits'], exact['logits']):.2e}), grads "
                      f"{rel_err(tp_all, exact_all):.2e} (1 GPU {rel_err(one_all, exact_all):.2e}); worst per-tensor "
                      f"error ratio {worst:.2f}", flush=True)
    finally:
        destroy_parallel()


# ---- PP = 2 -------------------------------------------------------------------------------------
def _pp2_fp32_like_one_gpu(rank, what, pp_rank, device, got_l, one_l, trained, single, exact) -> None:
    """fp32 PP=2 against one GPU. On CPU-gloo the two agree within 1e-5. On two H200s they do not
    (three runs, the same numbers each time: losses 1.07e-5 and stage-0
    weights 1.9e-4 apart, the one-GPU run itself 2.3e-5 / 6.0e-5 from fp64), with TF32 off, the GDN
    op on the PyTorch 'chunk' path (`place`) and deterministic kernels. Not traced; what fits: GEMMs
    of the two runs round differently at ~1e-7 (kernel choice per device and per buffer, another
    order of the gradient-norm sum), and AdamW turns such noise of near-zero gradients into +-lr
    steps of single elements. Merging each step's micro-batches moves the one-GPU run by only
    1.3e-6, so that spread is no yardstick here. So on the GPU each stage's weights must be as
    accurate as one GPU's against fp64 (ratio 2) plus 5e-4: 2.6x the measured difference, and 16-20x
    below what a 25% wrong learning rate does (measured on CPU, fp32: 8.1e-3 / 1.0e-2 of the
    weights, losses 4.6e-3 / 2.9e-3, caught by the caller's loss check, which needs them as accurate
    as one GPU's plus 1e-5)."""
    names = sorted(trained)
    if device == "cpu":
        assert_close(got_l, one_l, f"{what} fp32 step losses", 1e-5)
        _fp32_same_weights(trained, single, exact, f"{what} fp32 stage {pp_rank}", 1e-5, 1e-4)
        return
    got_w, one_w, exact_w = _cat(trained, names), _cat(single, names), _cat(exact, names)
    ratio = assert_as_accurate(got_w, one_w, exact_w, f"{what} fp32 stage {pp_rank} weights", torch.float32,
                               floor=5e-4)
    print(f"rank {rank} {what} fp32: PP=2 vs one GPU {rel_err(got_l, one_l):.3g} (losses), "
          f"{rel_err(got_w, one_w):.3g} (weights); weights vs fp64 {rel_err(got_w, exact_w):.3g} "
          f"(one GPU {rel_err(one_w, exact_w):.3g}, ratio {ratio:.2f})", flush=True)


def pp2_matches_one_gpu(rank: int, world_size: int, device: str = "cuda") -> None:
    """DeepSpeed's pipeline engine (ZeRO-1), five distillation steps: step losses and the weights
    each stage trained, for both setups of tests/parallel/_workers_pipeline."""
    exact_numerics(device)
    ctx = init_parallel(tp=1, pp=2)
    try:
        assert (ctx.pp_size, ctx.dp_size) == (2, 1)
        data = wpp.batches(wpp.STEPS, wpp.MICRO, wpp.BATCH, wpp.SEQ)
        loss_fn = pipe.DistillLoss(VOCAB, wpp.TEMPERATURE, wpp.CE_WEIGHT, tp_group=None)
        for tied, partition, checkpointing in wpp.SETUPS:
            what = f"PP=2 tied={tied} partition={partition} checkpointing={checkpointing}"
            init_exact = {n: p.detach().to(device, torch.float64) for n, p in wpp.models(tied)[0].named_parameters()}
            exact_losses, exact = wpp.single_process_run(tied, data, loss_fn, device, torch.float64)
            exact = {n: p.detach() for n, p in exact.named_parameters()}
            for dtype in DTYPES:
                init = {n: p.to(dtype) for n, p in init_exact.items()}
                want_losses, single = wpp.single_process_run(tied, data, loss_fn, device, dtype)
                losses, trained, teacher = wpp.pp_run(ctx, tied, partition, checkpointing, data, device, dtype)
                single = {n: p.detach() for n, p in single.named_parameters() if n in trained}
                assert not any(p.requires_grad or p.grad is not None for p in teacher.parameters())
                got_l, one_l, exact_l = (torch.tensor(x, dtype=torch.float64)
                                         for x in (losses, want_losses, exact_losses))
                if dtype == torch.float32:
                    _pp2_fp32_like_one_gpu(rank, what, ctx.pp_rank, device, got_l, one_l, trained, single,
                                           {n: exact[n] for n in trained})
                assert_as_accurate(got_l, one_l, exact_l, f"{what} step losses", dtype)
                _updates_as_accurate(trained, single, {n: exact[n] for n in trained}, init, init_exact,
                                     f"{what} stage {ctx.pp_rank}", dtype)
                if dtype == torch.bfloat16:
                    alt_losses, alt = wpp.single_process_run(tied, merged(data), loss_fn, device, dtype)
                    alt = {n: p.detach() for n, p in alt.named_parameters() if n in trained}
                    names = sorted(trained)
                    r_loss = assert_like_other_order(got_l, one_l, torch.tensor(alt_losses, dtype=torch.float64),
                                                    f"{what} step losses", floor=LOSS_FLOOR)
                    r_upd = assert_like_other_order(_deltas(trained, init, names), _deltas(single, init, names),
                                                   _deltas(alt, init, names), f"{what} stage {ctx.pp_rank} all updates")
                    print(f"rank {rank} {what} bf16 vs merged-micro-batch spread: losses ratio {r_loss:.2f}, "
                          f"updates ratio {r_upd:.2f}", flush=True)
                print(f"rank {rank} {what} {dtype}: losses err vs fp64 {rel_err(got_l, exact_l):.2e} "
                      f"(1 GPU {rel_err(one_l, exact_l):.2e})", flush=True)
    finally:
        destroy_parallel()


# ---- ZeRO-3 over DP (TP inside when the world has 4 ranks) ---------------------------------------
def zero3_matches_one_gpu(rank: int, world_size: int, device: str = "cuda", tp: int = 1) -> None:
    """ZeRO-3 student and teacher engines over DP = world_size / tp, five steps on the global
    batch == the single-GPU reference on the union of the data."""
    exact_numerics(device)
    data = batches(wz.STEPS, wz.GLOBAL_BATCH, 1, wz.SEQ)
    exact_losses, exact, clipped = wz.single_process_run(data, device, torch.float64, tp)
    assert clipped > 0, "the reference never clipped: gradient clipping would go untested"
    init_exact = {k: v.to(device, torch.float64) for k, v in wz.models(tp)[0].state_dict().items()}
    ctx = init_parallel(tp=tp, pp=1)
    try:
        assert ctx.dp_size == world_size // tp == 2
        what = f"ZeRO-3 DP={ctx.dp_size} TP={tp}"
        for dtype in DTYPES:
            want_losses, single, _ = wz.single_process_run(data, device, dtype, tp)
            losses, got = wz.zero3_run(ctx, data, device, dtype)
            assert all(v.device.type == device for v in got.values())
            got_l, one_l, exact_l = (torch.tensor(x, dtype=torch.float64) for x in (losses, want_losses, exact_losses))
            if dtype == torch.float32:
                tol = TP_FP32_TOL if tp > 1 else 1e-5
                assert_close(got_l, one_l, f"{what} fp32 step losses", tol)
                _fp32_same_weights(got, single, exact, f"{what} fp32 final", tol, 10 * tol)
            assert_as_accurate(got_l, one_l, exact_l, f"{what} step losses", dtype)
            init = {n: p.to(dtype) for n, p in init_exact.items()}
            _updates_as_accurate(got, single, exact, init, init_exact, what, dtype, TP_RATIO if tp > 1 else 2.0)
            if dtype == torch.bfloat16:
                alt_losses, alt, _ = wz.single_process_run(merged(data), device, dtype, tp)
                names = sorted(got)
                ratio = TP_RATIO if tp > 1 else 2.0
                r_loss = assert_like_other_order(got_l, one_l, torch.tensor(alt_losses, dtype=torch.float64),
                                                 f"{what} step losses", ratio, LOSS_FLOOR)
                r_upd = assert_like_other_order(_deltas(got, init, names), _deltas(single, init, names),
                                                _deltas(alt, init, names), f"{what} all updates", ratio)
                print(f"rank {rank} {what} bf16 vs merged-micro-batch spread: losses ratio {r_loss:.2f}, updates ratio "
                      f"{r_upd:.2f}", flush=True)
            print(f"rank {rank} {what} {dtype}: losses err vs fp64 {rel_err(got_l, exact_l):.2e} "
                  f"(1 GPU {rel_err(one_l, exact_l):.2e})", flush=True)
    finally:
        destroy_parallel()


def tp2_dp2_zero3_matches_one_gpu(rank: int, world_size: int, device: str = "cuda") -> None:
    zero3_matches_one_gpu(rank, world_size, device, tp=2)

