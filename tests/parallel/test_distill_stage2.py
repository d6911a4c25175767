"""Stage-2 distillation under DeepSpeed ZeRO-3 on 2 gloo ranks, and on DeepSpeed's pipeline engine with
PP=2 and TP=2 x PP=2 (tiny random teacher, CPU, fp32)."""
import json

import torch

from megatron_tc.testing import run_distributed
from tests.parallel import _workers_distill


def test_zero3_stage2_lowers_kl_and_resume_equals_uninterrupted_run(tmp_path):
    """6 steps straight vs 3 steps + checkpoint + a fresh job resuming: same losses, lr and final
    weights bit for bit; the held-out KL falls; only the last 2 checkpoints are kept."""
    run_distributed(_workers_distill.train_resume_matches_uninterrupted, 2, str(tmp_path), timeout=240)


def test_gdn_only_stage2_trains_the_gdn_mixers_and_nothing_else(tmp_path):
    """distill.stage2.trainable=gdn under ZeRO-3 on 2 ranks: after 2 steps every GDN mixer tensor has
    moved and every other tensor (embedding, norms, MLPs, the kept attention layers) is bit-identical."""
    run_distributed(_workers_distill.gdn_only_leaves_the_rest_of_the_student_as_it_was, 2, str(tmp_path), timeout=240)


def test_nan_loss_and_gradient_are_skipped_and_counted_or_abort(tmp_path):
    """nan_policy=skip: a NaN loss (step 1) and a NaN gradient (step 3) skip their updates and are
    counted; nan_policy=abort: a NaN loss stops the run with a NonFiniteError naming the step."""
    run_distributed(_workers_distill.nan_policies, 2, str(tmp_path), timeout=240)


def test_pipeline_parallel_stage2_resumes_exactly_and_gathers_the_student(tmp_path):
    """PP=2 through DeepSpeed's pipeline engine (ZeRO-1): stop after 2 of 4 steps, resume, same
    losses and gathered student as a straight run; both stages' tensors are trained."""
    run_distributed(_workers_distill.pipeline_resume_matches_uninterrupted, 2, str(tmp_path), timeout=240)


def test_tp2_pp2_stage2_equals_pp2_and_resumes_exactly(tmp_path):
    """TP=2 inside each of 2 pipeline stages (4 ranks) trains as PP=2 alone: the same step losses
    within 1e-5 and the same gathered student (all tensors within 1e-5, each within 2e-4: TP splits
    the GEMMs and sums the vocabulary shards, and AdamW turns that other reduction order into small
    update differences); stop after 2 of 4 steps + resume == the straight run, bit for bit."""
    from tests.parallel._workers_common import assert_close, assert_same_weights

    run_distributed(_workers_distill.pipeline_student, 2, str(tmp_path / "pp2"), timeout=240)
    run_distributed(_workers_distill.tp2_pp2_resume_matches_uninterrupted, 4, str(tmp_path), timeout=300)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]
              for run in ("full", "pp2")]
    assert len(losses[0]) == 4 and losses[0][-1] < losses[0][0], losses
    assert_close(torch.tensor(losses[0], dtype=torch.float64), torch.tensor(losses[1], dtype=torch.float64),
                 "TP=2 x PP=2 vs PP=2 step losses", 1e-5)
    got, want = torch.load(tmp_path / "full/student.pt"), torch.load(tmp_path / "pp2/student.pt")
    assert_same_weights(got, want, "TP=2 x PP=2 vs PP=2 student")


def test_activation_checkpointing_on_the_zero3_path_equals_the_plain_run(tmp_path):
    """parallel.activation_checkpointing=true with pp = 1 (ZeRO-3, trainable=mixers): every layer is
    checkpointed and 3 steps give the plain run's losses and weights."""
    run_distributed(_workers_distill.activation_checkpointing_equals_plain, 2, str(tmp_path), timeout=240)
