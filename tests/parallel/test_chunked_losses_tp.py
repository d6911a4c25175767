"""Chunked KL / CE on vocabulary shards over 2 gloo ranks == the single-device reference."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_chunked_losses


def test_chunked_losses_on_tp_shards_equal_single_device():
    run_distributed(_workers_chunked_losses.chunked_equals_single_device, 2, timeout=120)
