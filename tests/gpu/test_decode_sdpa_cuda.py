"""One-query decoding steps on CUDA avoid cuDNN's attention (a plan per KV length costs ~3 ms of
host time per call) and still give the full forward's logits."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, HybridCache, HybridLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cached_decode_matches_forward_without_cudnn(dtype, tol):
    torch.manual_seed(0)
    arch = ArchConfig(family="llama", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=256, layer_pattern="AA")
    model = HybridLM(arch).to("cuda", dtype).eval()
    ids = torch.randint(0, arch.vocab_size, (2, 40), device="cuda")
    with torch.no_grad():
        full = model(ids).float()
        cache = HybridCache(model.arch, max_length=40)
        model(ids[:, :32], cache=cache)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            steps = [model(ids[:, t:t + 1], cache=cache).float() for t in range(32, 40)]
    step_logits = torch.cat(steps, dim=1)
    err = (step_logits - full[:, 32:]).norm() / full[:, 32:].norm()
    assert err < tol, f"cached decoding vs full forward: relative error {err:.3g} > {tol:g}"
    names = {e.key for e in prof.key_averages()}
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
