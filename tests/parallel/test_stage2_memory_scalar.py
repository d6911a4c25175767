"""Stage 2's `memory_gb` scalar is the largest peak of any rank (pipeline and tensor-parallel ranks
hold different parts of the models), on every rank."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers


def test_the_peak_memory_logged_is_the_largest_ranks():
    run_distributed(_workers.peak_memory_is_the_largest_ranks, 2, timeout=120)
