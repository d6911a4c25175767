"""`parallel.zero_step.streamline_zero_step` on 2 gloo ranks: the same norms, clipping, updates
and NaN skips as DeepSpeed's own ZeRO-1 step; another DeepSpeed release keeps its own step. The
optimizer stage 2 builds on a CPU against AdamW written out in fp64."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_zero_step


def test_streamlined_zero1_step_equals_deepspeed_and_skips_nan_gradients():
    run_distributed(_workers_zero_step.streamlined_step_equals_deepspeed, 2, timeout=240)


def test_the_cpu_stage2_optimizer_steps_as_adamw_written_out_in_fp64():
    run_distributed(_workers_zero_step.stage2_cpu_adamw_equals_fp64_adamw, 1, timeout=240)
