"""PP=2 on DeepSpeed's pipeline engine (ZeRO-1, gloo, fp32): five distillation steps == one
process, for tied/untied heads, pattern/parameter partitions, with and without activation
checkpointing; TP=2 x PP=2 (4 processes): gradients == one process."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_pipeline


def test_pp2_distillation_steps_equal_single_process():
    run_distributed(_workers_pipeline.pp2_matches_single_process, 2)


def test_tp2_pp2_gradients_equal_single_process():
    run_distributed(_workers_pipeline.tp2_pp2_gradients_match_single_process, 4)
