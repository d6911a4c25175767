"""PP=2 on DeepSpeed's pipeline engine (ZeRO-1, gloo, fp32): five distillation steps == one
process, for tied/untied heads, pattern/parameter partitions, with and without activation
checkpointing."""
import os

import pytest

from megatron_tc.testing import run_distributed
from tests.parallel import _workers_pipeline


def test_pp2_distillation_steps_equal_single_process():
    run_distributed(_workers_pipeline.pp2_matches_single_process, 2)


@pytest.mark.skipif(os.environ.get("MEGATRON_TC_4PROC") != "1",
                    reason="4 processes (TP=2 x PP=2): set MEGATRON_TC_4PROC=1 (about a minute on 2 cores)")
def test_tp2_pp2_gradients_equal_single_process():
    run_distributed(_workers_pipeline.tp2_pp2_gradients_match_single_process, 4)
