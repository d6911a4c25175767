"""Module-level worker functions for tests/parallel (spawned processes must import them)."""
import torch
import torch.distributed as dist


def all_reduce_sum(rank: int, world_size: int) -> None:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    assert value.item() == expected, (value.item(), expected)


def fail_on_rank_one(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")


def hard_exit_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        import os
        os._exit(3)


def shutdown_leaves_no_group(rank: int, world_size: int) -> None:
    """Entry points end with shutdown_distributed(): no model-parallel groups, no default group."""
    from megatron.core import parallel_state as ps

    from megatron_tc.parallel.state import init_parallel, shutdown_distributed

    ctx = init_parallel(tp=2, pp=1)
    assert ctx.tp_size == 2 and ps.model_parallel_is_initialized()
    shutdown_distributed()
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    shutdown_distributed()  # a second call (nothing left) is harmless


def leave_after_error_wakes_the_waiting_rank(rank: int, world_size: int) -> None:
    """Rank 0 fails; rank 1, waiting in a barrier of megatron-core's groups' world, must hear of it
    while rank 0 still lives (rank 0 waits for its mark), not when rank 0's process ends."""
    import time

    from megatron_tc.distill.cli import peer_failed
    from megatron_tc.parallel.state import init_parallel, leave_after_error, mark_stopping

    init_parallel(tp=1, pp=1)
    if rank == 0:
        time.sleep(0.5)  # rank 1 is in its barrier by now
        start = time.monotonic()
        leave_after_error(timeout_s=20.0)
        waited = time.monotonic() - start
        assert not dist.is_initialized()
        assert waited < 15.0, f"rank 1 did not hear of the failure within {waited:.1f} s"
    else:
        try:
            dist.barrier()
        except RuntimeError as err:
            assert peer_failed(err), err
            mark_stopping()
        else:
            raise AssertionError("the barrier passed, though rank 0 left the group")


def shared_outcome_reaches_every_rank(rank: int, world_size: int) -> None:
    """An error of one rank's work is raised on every rank (picklable ones as they are, others as a
    RuntimeError naming them); with none, each rank gets its own value."""
    import threading

    import pytest

    from megatron_tc.data.documents import DataError
    from megatron_tc.parallel.state import shared_outcome

    def bad_data():
        raise DataError("data.source.paths: /nowhere does not exist")

    with pytest.raises(DataError, match="^data.source.paths: /nowhere does not exist$"):
        shared_outcome(bad_data if rank == 0 else None)

    def unpicklable():
        error = ValueError("a lock inside")
        error.lock = threading.Lock()
        raise error

    with pytest.raises(ValueError if rank == 1 else RuntimeError, match="a lock inside"):
        shared_outcome(unpicklable if rank == 1 else None)
    assert shared_outcome(lambda: rank * 10) == rank * 10


def peak_memory_is_the_largest_ranks(rank: int, world_size: int) -> None:
    """stage 2's memory_gb scalar: every rank gets the largest peak of all ranks."""
    from unittest import mock

    import torch

    from megatron_tc.distill import stage2

    with mock.patch.object(stage2, "_memory_gb", lambda device: 1.5 + 2.0 * rank):
        assert stage2.peak_memory_gb(torch.device("cpu")) == 1.5 + 2.0 * (world_size - 1)


def auto_choices_agree_on_mixed_devices(rank: int, world_size: int) -> None:
    """Rank 0 has a 64 GiB device, the others 8 GiB: the ZeRO stage and the split-teacher choice
    follow the smallest device on every rank; the agreed size is kept (no second collective)."""
    from types import SimpleNamespace
    from unittest import mock

    import torch

    from megatron_tc.bench.models import llama_1b, quarter_pattern
    from megatron_tc.config import apply_overrides, config_from_dict, load_config
    from megatron_tc.distill.stage2_setup import resolve_zero_stage
    from megatron_tc.model import HybridLM
    from megatron_tc.parallel import memory
    from megatron_tc.parallel.sharded_teacher import resolve_shard_teacher, teacher_fp32_bytes

    cpu, small = torch.device("cpu"), 8 * 2**30
    with torch.device("meta"):
        teacher = HybridLM(llama_1b())
        student = HybridLM(llama_1b().with_pattern(quarter_pattern(16)))
    cfg = load_config(overrides=["data.micro_batch_size=1", "data.seq_len=64"])
    ctx = SimpleNamespace(dp_size=world_size, pp_size=1, rank=rank)
    split = config_from_dict(apply_overrides({"model": {"teacher": "t"}}, ["parallel.tp=2"]))
    assert teacher_fp32_bytes(llama_1b()) > 0.5 * small  # the smallest device splits it, rank 0's would not
    with mock.patch.object(memory, "device_memory_bytes", lambda device: 64 * 2**30 if rank == 0 else small):
        assert memory.least_device_memory(cpu) == small
        assert resolve_zero_stage(cfg, ctx, cpu, student, teacher) == 3  # ZeRO-0 on rank 0's device alone
        assert resolve_shard_teacher(split, llama_1b(), cpu) is True
    with mock.patch.object(memory, "device_memory_bytes", lambda device: 1):
        assert memory.least_device_memory(cpu) == small
