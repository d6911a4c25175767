"""Stage 2 moves each CPU batch to the GPU through pinned memory without blocking the host; the
values arrive unchanged, also when the next batch is queued before the GPU is done."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.distill.stage2 import to_device

pytestmark = pytest.mark.gpu


def test_batches_reach_the_gpu_unchanged_behind_queued_work():
    busy = torch.randn(4096, 4096, device="cuda")
    batches = [torch.randint(0, 50_000, (8, 2048)) for _ in range(4)]
    arrived = []
    for ids in batches:
        busy = busy @ busy / 64.0  # keeps the GPU busy while the host goes on
        arrived.append(to_device(ids, torch.device("cuda")))
    torch.cuda.synchronize()
    for got, want in zip(arrived, batches):
        assert got.is_cuda and torch.equal(got.cpu(), want)
    cpu = torch.arange(5)
    assert to_device(cpu, torch.device("cpu")) is cpu
