"""ZeRO-3 over DP=2 (gloo, fp32): five distillation steps == one process; the teacher engine has no
optimizer and never gets gradients."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_zero


def test_zero3_dp2_distillation_equals_single_process_and_teacher_gets_no_grads():
    run_distributed(_workers_zero.zero3_matches_single_process, 2)


def test_zero3_dp2_with_activation_checkpointing_equals_single_process_without():
    run_distributed(_workers_zero.zero3_with_activation_checkpointing_matches_single_process, 2)
