"""Batched evaluation on CUDA (`eval.batch_size`, megatron_tc.distill.evaluation.score_rows): 16
windows per forward score what one window per forward scores, in fp32 and bf16, with the GDN
layers on fla. On CPU the two are bitwise equal (tests/unit/test_eval_batched_windows.py, and a
6.3M-parameter teacher on 65k tokens in bf16); on the GPU, GEMMs of another row count
may pick other kernels, so the bound is a rounding-level one: a window mixed up with another, or
attention across the windows of a batch, moves perplexity by far more than 1e-3.

Run on a GPU machine: `python -m pytest -q -s tests/gpu/test_eval_batching_cuda.py`.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from megatron_tc.distill.evaluation import score_rows, window_rows  # noqa: E402
from megatron_tc.eval.perplexity import make_windows  # noqa: E402
from megatron_tc.model import ArchConfig, HybridLM  # noqa: E402

PPL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}  # relative, batched vs one window per forward
KL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def model(pattern: str, seed: int, dtype: torch.dtype) -> HybridLM:
    arch = ArchConfig(family="llama", vocab_size=300, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=64, intermediate_size=512, layer_pattern=pattern, tie_embeddings=True,
                      gdn_conv_size=4)
    torch.manual_seed(seed)
    return HybridLM(arch, init_std=0.1).cuda().to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_evaluation_matches_one_window_per_forward(dtype):
    student, teacher = model("GAGA", 1, dtype), model("AAAA", 0, dtype)
    ids = torch.randint(0, 300, (32 * 128 + 50,), generator=torch.Generator().manual_seed(0))
    rows = window_rows(make_windows(ids, 128))  # 32 windows of 128 and a tail of 50
    single = score_rows(student, teacher, rows, 0, 1, device="cuda")
    batched = score_rows(student, teacher, rows, 0, 1, device="cuda", batch_size=16)
    ppl_diff = abs(batched["ppl"] / single["ppl"] - 1)
    kl_diff = abs(batched["kl"] / single["kl"] - 1)
    print(f"{dtype}: ppl {single['ppl']:.6g} vs batched {batched['ppl']:.6g} (rel {ppl_diff:.2e}); "
          f"kl rel {kl_diff:.2e}; top-1 {single['top1_agree']:.6f} vs {batched['top1_agree']:.6f}")
    assert batched["tokens"] == single["tokens"] == 32 * 127 + 49
    assert ppl_diff <= PPL_TOL[dtype] and kl_diff <= KL_TOL[dtype]
    assert abs(batched["top1_agree"] - single["top1_agree"]) <= (1e-3 if dtype == torch.float32 else 5e-3)
