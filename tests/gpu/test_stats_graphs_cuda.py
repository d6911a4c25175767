"""The statistics pass replayed from CUDA graphs (`calibrate.graphs`) == the eager pass.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_stats_graphs_cuda.py` (fla compiles the
readout's fp32 recurrence for this shape once, about a minute). SmolLM2's head shapes, four layers,
a bf16 teacher, three batches without documents, a readout call per layer: each sweep runs its
first layer eagerly, captures its second and replays the rest with their weights and inputs copied
in. Element-wise kernels and reductions are the same on the same values; cuBLAS may pick other GEMM
algorithms under capture, so every sum must equal the eager pass's within 1e-4 (relative norm), and
the test prints how many are bit-identical (with a single fp32 GEMM over all tokens for the readout
products, 660 of 814 were, the worst 2.7e-5 off).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla")

from megatron_tc.calibrate import graphs, stats as stats_module  # noqa: E402
from megatron_tc.calibrate.strategies import get_strategy  # noqa: E402
from megatron_tc.model import ArchConfig, HybridLM  # noqa: E402


def smollm2_heads(num_layers: int) -> ArchConfig:
    return ArchConfig(family="llama", vocab_size=4096, hidden_size=576, num_layers=num_layers, num_heads=9,
                      num_kv_heads=3, head_dim=64, intermediate_size=1536, tie_embeddings=True,
                      rope_theta=100000.0, norm_eps=1e-5)


def test_replayed_pass_equals_eager_pass_cuda(monkeypatch):
    torch.manual_seed(0)
    model = HybridLM(smollm2_heads(4)).to("cuda", torch.bfloat16).eval()
    batches = [{"input_ids": torch.randint(0, 4096, (4, 2048), device="cuda")} for _ in range(3)]
    # a readout call per layer (not the groups sweep 2 makes by default), so its signature repeats
    monkeypatch.setattr(stats_module, "readout_stacked_layers", lambda tokens, per_token: 1)
    captured = []
    init = graphs._Captured.__init__
    monkeypatch.setattr(graphs._Captured, "__init__",
                        lambda self, *args: (captured.append(args[3]), init(self, *args))[1])

    def run():
        return stats_module.collect_stats(model, batches, [0, 1, 3], {"teacher_sha256": "t", "seq_len": 2048},
                             readout_strategies=[get_strategy("taylor_calibrate")],
                             student_arch=model.arch.with_pattern("GGAG"), progress=False)

    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    replayed = run()
    assert len(captured) == 2  # one graph per sweep, shared by the layers
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    eager = run()
    assert len(captured) == 2
    assert replayed.sums.keys() == eager.sums.keys() and any(k.startswith("readout.") for k in eager.sums)
    errors = {key: float((replayed.sums[key] - value).norm() / value.norm().clamp_min(1e-300))
              for key, value in eager.sums.items()}
    differ = {key: err for key, err in errors.items() if err > 0}
    print(f"{len(errors) - len(differ)} of {len(errors)} sums bit-identical; differ: {differ}")
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])
