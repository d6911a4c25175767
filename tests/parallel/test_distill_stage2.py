"""Stage-2 distillation under DeepSpeed ZeRO-3 on 2 gloo ranks (tiny random teacher, CPU, fp32)."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_distill


def test_zero3_stage2_lowers_kl_and_resume_equals_uninterrupted_run(tmp_path):
    """6 steps straight vs 3 steps + checkpoint + a fresh job resuming: same losses, lr and final
    weights bit for bit; the held-out KL falls; only the last 2 checkpoints are kept."""
    run_distributed(_workers_distill.train_resume_matches_uninterrupted, 2, str(tmp_path), timeout=240)


def test_nan_loss_and_gradient_are_skipped_and_counted_or_abort(tmp_path):
    """nan_policy=skip: a NaN loss (step 1) and a NaN gradient (step 3) skip their updates and are
    counted; nan_policy=abort: a NaN loss stops the run with a NonFiniteError naming the step."""
    run_distributed(_workers_distill.nan_policies, 2, str(tmp_path), timeout=240)


def test_pipeline_parallel_stage2_resumes_exactly_and_gathers_the_student(tmp_path):
    """PP=2 through DeepSpeed's pipeline engine (ZeRO-1): stop after 2 of 4 steps, resume, same
    losses and gathered student as a straight run; both stages' tensors are trained."""
    run_distributed(_workers_distill.pipeline_resume_matches_uninterrupted, 2, str(tmp_path), timeout=240)
