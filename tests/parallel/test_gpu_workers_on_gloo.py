"""The NCCL parity suite's workers (tests/gpu/_workers_nccl.py) on 2 (TP=2 x DP=2: 4) CPU processes over gloo.

The GPU suite runs only where GPUs are; here its workers run with `device="cpu"` on every CI run,
so their logic (fp32 and bf16 paths, fp64 references, the merged-micro-batch spread) is exercised
without a GPU. Their bf16 pipeline run is the
only one of the CPU suite that sends bf16 teacher activations through DeepSpeed's pipeline engine
(the int8 transport of megatron_tc/parallel/pipeline.py). TP=2 x DP=2 with ZeRO-3 needs 4 GPUs: here
its worker runs on 4 gloo processes. About 45 s on 2 cores.
"""
from __future__ import annotations

import pytest

from megatron_tc.testing import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

from tests.gpu import _workers_nccl  # noqa: E402


@pytest.mark.parametrize("worker,world_size", [("tp2_matches_one_gpu", 2), ("pp2_matches_one_gpu", 2),
                                               ("zero3_matches_one_gpu", 2),
                                               ("tp2_dp2_zero3_matches_one_gpu", 4)])  # the 4-GPU test, never lent a GPU kind
def test_gpu_parity_workers_pass_on_cpu_gloo(worker, world_size):
    run_distributed(getattr(_workers_nccl, worker), world_size, "cpu", timeout=300.0, backend="gloo")
