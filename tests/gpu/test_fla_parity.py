"""fla's Triton gated delta rule vs the PyTorch reference on CUDA, forward and backward.

Run on a GPU machine: `python -m pytest -q tests/gpu/test_fla_parity.py`.
The reference is the float64 recurrence; errors are max |a - b| / max |b| per tensor. Bounds
follow what fla achieves on an H200 (about 1.5e-3 fp32, 5e-3 bf16 measured), with margin.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # conftest also skips gpu-marked tests without CUDA
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("fla.ops.gated_delta_rule")

from megatron_tc.model import ArchConfig, HybridLM  # noqa: E402
from megatron_tc.model.ops import gated_delta_rule  # noqa: E402

TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(b, t, h, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    return dict(
        q=r(b, t, h, d), k=r(b, t, h, d), v=r(b, t, h, d),
        g=-torch.rand(b, t, h, generator=gen, device="cuda", dtype=torch.float64) * 0.5,
        beta=torch.rand(b, t, h, generator=gen, device="cuda", dtype=torch.float64),
        initial_state=r(b, h, d, d) * 0.3,
    )


def run(backend, inputs, dtype, doc_ids=None):
    """Forward + backward; q/k/v in `dtype`, gates and state in fp32 (as the GDN layer passes them)."""
    leaves = {}
    for n, x in inputs.items():
        cast = dtype if n in ("q", "k", "v") else (torch.float64 if dtype == torch.float64 else torch.float32)
        leaves[n] = x.detach().to(cast).requires_grad_(True)  # a fresh leaf per run
    o, s = gated_delta_rule(**leaves, output_final_state=True, doc_ids=doc_ids, use_qk_l2norm=True, backend=backend)
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(o.shape, generator=gen, device="cuda", dtype=torch.float64)
    ds = torch.randn(s.shape, generator=gen, device="cuda", dtype=torch.float64)
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    return o.double(), s.double(), {n: leaves[n].grad.double() for n in NAMES}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_chunk_matches_reference(dtype, packed):
    b, t, h, d = 2, 300, 4, 64
    inputs = make_inputs(b, t, h, d)
    doc_ids = None
    if packed:
        doc_ids = torch.zeros(b, t, dtype=torch.long, device="cuda")
        doc_ids[0, 77:] = 1
        doc_ids[0, 200:] = 2
        doc_ids[1, 128:] = 1
    o_ref, s_ref, g_ref = run("recurrent", inputs, torch.float64, doc_ids)
    o, s, grads = run("fla_chunk", inputs, dtype, doc_ids)
    errors = {"o": rel(o, o_ref), "state": rel(s, s_ref), **{n: rel(grads[n], g_ref[n]) for n in NAMES}}
    print(dtype, "packed" if packed else "batch", {k: f"{v:.1e}" for k, v in errors.items()})
    assert all(e < TOL[dtype] for e in errors.values()), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_recurrent_decoding_matches_reference(dtype):
    inputs = make_inputs(3, 9, 2, 64, seed=1)
    with torch.no_grad():
        ref, s_ref = gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm=True, backend="recurrent")
        cast = {n: (x.to(dtype) if n in ("q", "k", "v") else x.float()) for n, x in inputs.items()}
        o, s = gated_delta_rule(**cast, output_final_state=True, use_qk_l2norm=True, backend="fla_recurrent")
    assert rel(o.double(), ref) < TOL[dtype] and rel(s.double(), s_ref) < TOL[dtype]


def test_hybrid_model_fla_vs_chunk_backend():
    """A whole hybrid with conv: fla backend and the PyTorch chunked backend agree (fp32)."""
    arch = ArchConfig(family="llama", vocab_size=300, hidden_size=128, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=64, intermediate_size=256, layer_pattern="GAG", gdn_conv_size=4)
    torch.manual_seed(0)
    model = HybridLM(arch).cuda()
    ids = torch.randint(0, 300, (2, 130), device="cuda")
    grads = {}
    for backend in ("chunk", "fla"):
        model.zero_grad()
        model.set_gdn_backend(backend)
        logits = model(ids)
        logits.logsumexp(-1).mean().backward()
        grads[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert rel(grads["fla"][0], grads["chunk"][0]) < 5e-3
    for name, g in grads["chunk"][1].items():
        assert rel(grads["fla"][1][name], g) < 2e-2, name


@pytest.mark.parametrize("conv", [0, 4], ids=["no_conv", "conv4"])
def test_gdn_layer_matches_fla_layer(conv):
    """Our GatedDeltaNet state dict loads into fla's `GatedDeltaNet` layer and gives its output."""
    from fla.layers import GatedDeltaNet as FlaGatedDeltaNet

    from megatron_tc.model import GatedDeltaNet

    arch = ArchConfig(family="llama", vocab_size=10, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=64, intermediate_size=8, layer_pattern="G", gdn_conv_size=conv, gdn_b_bias=False)
    torch.manual_seed(0)
    mine = GatedDeltaNet(arch, 0).cuda().eval()
    theirs = FlaGatedDeltaNet(hidden_size=128, expand_v=1, head_dim=64, num_heads=2, use_short_conv=conv > 0,
                              conv_size=max(conv, 1), norm_eps=arch.norm_eps).cuda().eval()
    theirs.load_state_dict(mine.state_dict(), strict=True)
    x = torch.randn(2, 40, 128, device="cuda")
    with torch.no_grad():
        mine.set_backend("chunk")
        want = mine(x)
        got = theirs(x)[0]
    assert rel(got.double(), want.double()) < 5e-3
