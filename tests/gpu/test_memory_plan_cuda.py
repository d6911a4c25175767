"""The memory plan's per-layer activation term against the CUDA allocator: one attention and one
Gated DeltaNet layer (fla's chunked kernel, compiled blocks, bf16), the bytes a training forward
leaves allocated for backward per token, input included.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_memory_plan_cuda.py` (fla compiles its
forward kernels for this shape on first use, about a minute on a cold cache).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla")

from megatron_tc.bench.activation_memory import layer_saved_bytes  # noqa: E402
from megatron_tc.model import ArchConfig  # noqa: E402
from megatron_tc.parallel.memory_plan import layer_activation_bytes  # noqa: E402


@pytest.mark.parametrize("kind", ["A", "G"])
def test_layer_activation_bytes_match_the_cuda_allocator(kind):
    arch = ArchConfig(family="llama", vocab_size=1024, hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=4,
                      head_dim=128, intermediate_size=8192, layer_pattern="AG")  # the 1.1B preset's layer shapes
    measured = layer_saved_bytes(arch, kind, 2, 2048, torch.device("cuda"))
    assert abs(layer_activation_bytes(arch, kind) - measured) <= 0.05 * measured, (kind, measured)
