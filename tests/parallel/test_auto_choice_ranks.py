"""The automatic choices (ZeRO stage, split teacher) come out the same on every rank when the
ranks' devices differ in size: they follow the job's smallest device."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers


def test_every_rank_chooses_for_the_smallest_device():
    run_distributed(_workers.auto_choices_agree_on_mixed_devices, 2, timeout=120)
