"""TP=2 over 2 gloo processes == one process: logits, every parameter gradient, vocab-parallel
losses, and three ZeRO-3 distillation steps of the tensor-parallel model."""
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_tp


def test_tp2_logits_grads_and_vocab_parallel_losses_equal_single_process():
    run_distributed(_workers_tp.tp_worker, 2)
