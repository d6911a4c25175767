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
