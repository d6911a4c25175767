"""megatron_tc.parallel.comm: which device a collective's tensor travels on, and the collectives
themselves over gloo (tests/gpu/test_comm_nccl.py runs the same worker over NCCL)."""
import pytest
import torch

from megatron_tc.parallel.comm import backend_device_types, device_for
from megatron_tc.testing import run_distributed
from tests.parallel import _workers_comm

CPU = torch.device("cpu")


def test_backend_device_types():
    assert backend_device_types("cuda:nccl") == {"cuda"}
    assert backend_device_types("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert backend_device_types("cpu:gloo,cuda:gloo") == {"cpu", "cuda"}
    assert backend_device_types("nccl") == {"cuda"}
    assert backend_device_types("gloo") == {"cpu"}


def test_gloo_keeps_cpu_tensors_on_the_cpu():
    assert device_for(CPU, "cpu:gloo,cuda:gloo") == CPU
    assert device_for(CPU, "cpu:gloo,cuda:nccl") == CPU  # the mixed default group: gloo serves the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="parallel.backend=gloo"):
        device_for(CPU, "cuda:nccl")


def test_collectives_over_gloo_keep_the_callers_tensors():
    run_distributed(_workers_comm.collectives_keep_the_callers_device, 2, "cpu", timeout=120)
