"""`parallel.zero_step.streamline_zero_step` on 2 gloo ranks: the same norms, clipping, updates
and NaN skips as DeepSpeed's own ZeRO-1 step; another DeepSpeed release keeps its own step."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_zero_step


def test_streamlined_zero1_step_equals_deepspeed_and_skips_nan_gradients():
    run_distributed(_workers_zero_step.streamlined_step_equals_deepspeed, 2, timeout=240)
