"""The multi-process helper itself: a child's failure must fail the test."""
import pytest

from megatron_tc.testing import run_distributed
from tests.parallel import _workers


def test_collective_runs_on_two_gloo_ranks():
    run_distributed(_workers.all_reduce_sum, 2)


def test_child_exception_is_reported_with_rank_and_traceback():
    with pytest.raises(AssertionError, match=r"rank 1 raised:[\s\S]*deliberate failure on rank 1"):
        run_distributed(_workers.fail_on_rank_one, 2, timeout=60)


def test_child_hard_exit_is_reported():
    with pytest.raises(AssertionError, match="rank 0 exited with code 3"):
        run_distributed(_workers.hard_exit_on_rank_zero, 2, timeout=60)


def test_nccl_without_enough_gpus_or_unknown_backend_is_refused_before_spawning():
    import torch

    too_many = torch.cuda.device_count() + 1
    with pytest.raises(RuntimeError, match=r"one GPU per rank|no NCCL"):
        run_distributed(_workers.all_reduce_sum, too_many, backend="nccl")
    with pytest.raises(ValueError, match="backend 'mpi' is unknown"):
        run_distributed(_workers.all_reduce_sum, 2, backend="mpi")


def test_shutdown_distributed_drops_every_group():
    pytest.importorskip("megatron.core")
    run_distributed(_workers.shutdown_leaves_no_group, 2, timeout=120)
