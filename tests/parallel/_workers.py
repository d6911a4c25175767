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
