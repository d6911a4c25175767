"""The parallel parity suite of tests/parallel on GPUs over NCCL, fp32 and bf16.

TP=2 vs one GPU (logits and the gradient of every parameter), PP=2 vs one GPU (five distillation
steps on DeepSpeed's pipeline engine: step losses, trained weights), ZeRO-3 over DP=2 vs one GPU
on the union of the data (five steps), and TP=2 x DP=2 under ZeRO-3 when 4 GPUs are visible.
fp32 runs with TF32 off and is compared with the one-GPU run directly (relative 1e-5; 2e-5 where
TP splits the GEMMs; PP=2 by its accuracy against fp64: _workers_nccl.py says why);
bf16 (and fp32 too) must be at most 2x (TP: 3x) as far from an fp64 run as
the one-GPU run of the same precision is, plus a floor (tests/gpu/_workers_nccl.py says why).
GDN uses the pure-PyTorch 'chunk' kernel and the element-wise blocks run eagerly here (fla and the
compiled blocks take ~1 min per shape to compile; both are tested against these paths elsewhere).
Wall time on 2 H200s: 70-90 s per test; about 5 minutes in all.

Run on a GPU machine, with NVLink multicast off:
  export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python -m pytest -q -s tests/gpu/test_parallel_nccl.py
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_tc.testing import run_distributed

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2 or not dist.is_nccl_available():  # conftest also skips gpu tests without CUDA
    pytest.skip("needs 2 or more CUDA devices and NCCL", allow_module_level=True)
pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

from tests.gpu import _workers_nccl  # noqa: E402

TIMEOUT = 300.0  # each test takes about a minute; a hang must not eat the device time


def test_tp2_logits_and_grads_match_one_gpu_fp32_bf16():
    run_distributed(_workers_nccl.tp2_matches_one_gpu, 2, timeout=TIMEOUT, backend="nccl")


def test_pp2_training_steps_match_one_gpu_fp32_bf16():
    run_distributed(_workers_nccl.pp2_matches_one_gpu, 2, timeout=TIMEOUT, backend="nccl")


def test_zero3_dp2_training_steps_match_one_gpu_fp32_bf16():
    run_distributed(_workers_nccl.zero3_matches_one_gpu, 2, timeout=TIMEOUT, backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="TP=2 x DP=2 needs 4 GPUs")
def test_tp2_dp2_zero3_training_steps_match_one_gpu_fp32_bf16():
    run_distributed(_workers_nccl.tp2_dp2_zero3_matches_one_gpu, 4, timeout=TIMEOUT, backend="nccl")
