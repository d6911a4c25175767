"""Workers for tests/parallel/test_zero_step.py: ZeRO-1 over 2 gloo ranks, DeepSpeed's optimizer
step as shipped against the same step after `streamline_zero_step`."""
from __future__ import annotations

import copy

import torch

from megatron_tc.config import deepspeed_template_path
from megatron_tc.parallel import deepspeed_engine as dse
from megatron_tc.parallel.state import destroy_parallel, init_parallel
from megatron_tc.parallel.zero_step import streamline_zero_step
from tests.parallel._workers_common import assert_same_weights, batches, on
from tests.parallel._workers_zero import SEQ, kl_loss, models

LR, CLIP = 2e-3, 0.05  # a small clip: every step is clipped, so the norm decides the update


def _engine(student, ctx, streamlined: bool):
    cfg = dse.build_deepspeed_config(zero_stage=1, micro_batch_size=1, global_batch_size=2, dp_size=ctx.dp_size,
                                     lr=LR, grad_clip=CLIP, base=deepspeed_template_path(1))
    engine = dse.build_student_engine(copy.deepcopy(student), cfg, ctx, streamline=False)
    # the bf16 default (fp32 here): DeepSpeed scans every gradient for NaN/inf before the step
    engine.optimizer.check_grad_overflow = True
    if streamlined:
        assert streamline_zero_step(engine)
    return engine


def _step(engine, teacher, ids, poison: bool = False) -> tuple[float, bool]:
    with torch.no_grad():
        teacher_logits = teacher(ids)
    loss = kl_loss(engine(ids), teacher_logits)
    engine.backward(loss * float("nan") if poison else loss)
    engine.step()
    return float(engine.get_global_grad_norm() or float("nan")), engine.was_step_applied()


def _other_release_is_left_alone(engine) -> None:
    """A DeepSpeed release other than the one the replacement was written against keeps its step."""
    import warnings

    import deepspeed

    version = deepspeed.__version__
    deepspeed.__version__ = "0.20.0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not streamline_zero_step(engine)
    finally:
        deepspeed.__version__ = version
    assert any("keeps its per-tensor checks" in str(w.message) for w in caught)
    assert "get_grad_norm_direct" not in vars(engine.optimizer)


def streamlined_step_equals_deepspeed(rank: int, world_size: int) -> None:
    """Per step: the same global gradient norm (each rank holds half of ZeRO-1's partitions, so
    the norm is all-reduced), the same weights after 3 clipped steps, and a NaN step skipped by
    both, leaving the weights as they were."""
    ctx = init_parallel(tp=1, pp=1)
    try:
        student, teacher = models()
        teacher.requires_grad_(False)
        shipped, streamlined = _engine(student, ctx, False), _engine(student, ctx, True)
        assert "get_grad_norm_direct" not in vars(shipped.optimizer)
        assert {"get_grad_norm_direct", "check_overflow"} <= set(vars(streamlined.optimizer))
        data = batches(3, 2, 1, SEQ)
        for step in data:
            (ids, _), = on("cpu", step[ctx.dp_rank::ctx.dp_size])
            want, got = _step(shipped, teacher, ids), _step(streamlined, teacher, ids)
            assert want[1] and got[1], "a finite step was skipped"
            assert want[0] > CLIP, "the step was not clipped"
            torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
        state = lambda e: {k: v.detach().clone() for k, v in e.module.state_dict().items()}  # noqa: E731
        before = state(streamlined)
        assert_same_weights(before, state(shipped), "streamlined ZeRO-1 step")
        (ids, _), = on("cpu", data[0][ctx.dp_rank::ctx.dp_size])
        assert not _step(shipped, teacher, ids, poison=True)[1]
        assert not _step(streamlined, teacher, ids, poison=True)[1], "a NaN gradient was applied"
        for name, value in state(streamlined).items():
            assert torch.equal(value, before[name]), f"{name} changed in a skipped step"
        _other_release_is_left_alone(shipped)
        dse.release_engine(shipped)
        dse.release_engine(streamlined)
    finally:
        destroy_parallel()


def stage2_cpu_adamw_equals_fp64_adamw(rank: int, world_size: int) -> None:
    """The optimizer stage 2 builds on a CPU (`stage2_deepspeed_config`: PyTorch's fused AdamW under
    ZeRO-1, lr, betas, eps and weight decay from the config and the shipped JSON) steps a parameter
    as AdamW written out in fp64 does, up to fp32 rounding."""
    from pathlib import Path

    from megatron_tc.config import load_config
    from megatron_tc.distill.stage2_setup import stage2_deepspeed_config

    ctx = init_parallel(tp=1, pp=1)
    try:
        tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
        cfg = load_config(tiny, ["data.global_batch_size=1", "data.micro_batch_size=1", "distill.stage2.lr=1e-2",
                                 "distill.stage2.weight_decay=0.1", "distill.stage2.grad_clip=0",
                                 "parallel.zero_stage=1"])
        gen = torch.Generator().manual_seed(0)
        start, grads = torch.randn(4096, generator=gen), [torch.randn(4096, generator=gen) for _ in range(5)]

        class Linear(torch.nn.Module):  # loss = w . g: the gradient is g
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(start.clone())

            def forward(self, g: torch.Tensor) -> torch.Tensor:
                return (self.w * g).sum()

        ds = stage2_deepspeed_config(cfg, ctx, torch.device("cpu"), None, Linear())
        params = ds["optimizer"]["params"]
        assert params["fused"] is True and ds["zero_optimization"]["stage"] == 1
        engine = dse.build_student_engine(Linear(), ds, ctx)
        lr, wd, eps, (b1, b2) = params["lr"], params["weight_decay"], params["eps"], params["betas"]
        assert (lr, wd) == (1e-2, 0.1)
        ref = start.double()
        m, v = torch.zeros_like(ref), torch.zeros_like(ref)
        for t, g in enumerate(grads, start=1):
            engine.backward(engine(g))
            engine.step()
            ref = ref * (1 - lr * wd)
            m = b1 * m + (1 - b1) * g.double()
            v = b2 * v + (1 - b2) * g.double() ** 2
            ref = ref - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        got = engine.module.w.detach().double()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        assert (got - start.double()).abs().max() > 1e-2  # five steps of lr 1e-2 moved it
    finally:
        destroy_parallel()
