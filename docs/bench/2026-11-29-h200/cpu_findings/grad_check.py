"""2a: is bench_train's max per-tensor gradient error (0.70 on dt_bias) bf16 noise? CPU, PyTorch chunked GDN.

Runs one fwd/bwd of the SmolLM2-preset student (random weights, random teacher logits, KL) in:
  ref   fp32, chunk backend                     (bench_train's reference)
  amp   bf16 CPU autocast, chunk backend        (the whole model incl. the GDN op's matmuls in bf16)
  ampop bf16 autocast, GDN op itself in fp32    (only the GDN kernel exact: isolates the kernel)
  f64   float64 (checks the fp32 reference)
and per-token pre-activation gradients of dt_bias (z = a_proj x + dt_bias) and b_proj.bias.
"""
import os, sys, time, json, math
OUTDIR = os.environ.get("FINDINGS_DIR", "/tmp")
from pathlib import Path
import torch, torch.nn.functional as F
REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
from megatron_tc.bench.models import PRESETS, quarter_pattern
from megatron_tc.model import HybridLM
from megatron_tc.model import gdn as gdn_mod
from megatron_tc.distill.losses import LossWeights, distill_loss

preset = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 512
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ref", "amp", "ampop", "f64"]
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 0
torch.manual_seed(0)
arch = PRESETS[preset]()
if layers:
    from dataclasses import replace
    arch = replace(arch, num_layers=layers)  # may fail if pattern fixed
student = HybridLM(arch.with_pattern(quarter_pattern(arch.num_layers)))
teacher = HybridLM(arch).eval().requires_grad_(False)
student.set_gdn_backend("chunk")
ids = torch.randint(0, arch.vocab_size, (1, T))
with torch.no_grad():
    t_logits = teacher(ids)
del teacher

captured = {}
orig_gates = gdn_mod.GatedDeltaNet.gates
def gates(self, x):
    z = self.a_proj(x).float() + self.dt_bias.float()
    zb = self.b_proj(x).float()
    if z.requires_grad:
        z.retain_grad(); zb.retain_grad()
    captured[self.layer_idx] = (z, zb)
    return -self.A_log.float().exp() * F.softplus(z), torch.sigmoid(zb)
gdn_mod.GatedDeltaNet.gates = gates

orig_rule = gdn_mod.gated_delta_rule
def rule_fp32(*a, **k):
    with torch.autocast("cpu", enabled=False):
        a = [x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in a]
        return orig_rule(*a, **k)

def run(mode):
    model = student
    if mode == "f64":
        model = student.double()
    gdn_mod.gated_delta_rule = rule_fp32 if mode == "ampop" else orig_rule
    model.zero_grad(set_to_none=True)
    captured.clear()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode in ("amp", "ampop") else torch.autocast("cpu", enabled=False)
    t0 = time.time()
    with ctx:
        logits = model(ids)
    tl = t_logits.double() if mode == "f64" else t_logits
    loss, _ = distill_loss(logits, tl, ids, arch.vocab_size, LossWeights())
    loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    pre = {i: (z.grad.detach().double().clone(), zb.grad.detach().double().clone()) for i, (z, zb) in captured.items()}
    print(f"{mode}: loss {loss.item():.6f} in {time.time()-t0:.0f}s", flush=True)
    return float(loss), grads, pre

for m in modes:
    torch.save(run(m), f"{OUTDIR}/grads_{preset}_{T}_{m}.pt")
