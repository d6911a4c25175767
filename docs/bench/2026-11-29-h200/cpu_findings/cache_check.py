"""2b: cached decoding vs full forward in bf16 on CPU (PyTorch backends: chunk prefill, recurrent decode).

For the SmolLM2 preset teacher (all A) and student (quarter A), random weights as bench_inference:
  cached_vs_full  bf16: prefill 300 + 3 decode steps vs one forward over 304 (bench's check)
  cached_vs_full  fp32 (must be ~1e-6: the cache path is exact)
  bf16_vs_fp32    full forward in bf16 vs fp32, same weights (the model's own bf16 noise)
  sensitivity     fp32: input embeddings perturbed by 1e-3 relative noise -> logits rel change
  per-layer trace of the bf16 cached-vs-full hidden-state error
"""
import sys, copy
from pathlib import Path
import torch
REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
from megatron_tc.bench.common import rel_err
from megatron_tc.bench.models import PRESETS, quarter_pattern
from megatron_tc.model import HybridCache, HybridLM

preset = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 300
roles = sys.argv[3].split(",") if len(sys.argv) > 3 else ["teacher", "student"]
arch = PRESETS[preset]()
torch.manual_seed(0)

def trace_forward(model, ids, cache=None):
    """hidden after each layer [B,T,d] list, and logits."""
    hs = []
    pos = model.resolve_positions(ids, None, None, cache)
    x = model.embed(ids)
    for layer in model.layers:
        x = layer(x, pos, None, cache)
        hs.append(x)
    if cache is not None:
        cache.advance(ids.shape[1])
    return hs, model.logits(model.norm(x))

@torch.no_grad()
def cached_vs_full(model, ids, t):
    hs_full, full = trace_forward(model, ids)
    cache = HybridCache(model.arch)
    hs_pre, lp = trace_forward(model, ids[:, :t], cache)
    steps, hsteps = [lp[:, -1:]], []
    for i in range(3):
        h, lg = trace_forward(model, ids[:, t + i:t + i + 1], cache)
        steps.append(lg); hsteps.append(h)
    err = rel_err(torch.cat(steps, 1), full[:, t - 1:t + 3])
    # per layer: hidden of positions t..t+2 (decoded) vs full
    per_layer = []
    for li in range(len(model.layers)):
        dec = torch.cat([hsteps[i][li] for i in range(3)], 1)
        per_layer.append(rel_err(dec, hs_full[li][:, t:t + 3]))
    return err, per_layer, full

for role in roles:
    pattern = "A" * arch.num_layers if role == "teacher" else quarter_pattern(arch.num_layers)
    torch.manual_seed(1)
    m32 = HybridLM(arch.with_pattern(pattern)).eval()
    ids = torch.randint(0, arch.vocab_size, (1, T + 4))
    e32, pl32, full32 = cached_vs_full(m32, ids, T)
    with torch.no_grad():  # sensitivity: 1e-3 relative noise on the embeddings
        emb = m32.embed_tokens.weight.data.clone()
        m32.embed_tokens.weight.data += 1e-3 * emb.norm(dim=1, keepdim=True) / emb.shape[1] ** 0.5 * torch.randn_like(emb)
        _, pert = trace_forward(m32, ids)
        m32.embed_tokens.weight.data.copy_(emb)
    sens = rel_err(pert[:, T - 1:T + 3], full32[:, T - 1:T + 3])
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    e16, pl16, full16 = cached_vs_full(m16, ids, T)
    b_vs_f = rel_err(full16[:, T - 1:T + 3], full32[:, T - 1:T + 3])
    print(f"{preset} {role} {pattern}")
    print(f"  cached_vs_full fp32 {e32:.2e}  bf16 {e16:.4f}   bf16_vs_fp32 full {b_vs_f:.4f}   sensitivity(1e-3 emb) {sens:.4f}")
    print("  per-layer bf16 cached-vs-full hidden err:", " ".join(f"{k}{e:.3f}" for k, e in zip(pattern, pl16)))
    print("  per-layer fp32 cached-vs-full hidden err:", " ".join(f"{e:.0e}" for e in pl32), flush=True)
    del m16, m32
