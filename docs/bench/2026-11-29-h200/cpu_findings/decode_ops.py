"""3: aten ops per decoding step of HybridLM, per layer kind (CPU, tiny SmolLM2-shaped model).
Every aten op on CUDA is (at least) one dispatch + usually one kernel launch."""
import sys, time, collections
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode
REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
from megatron_tc.bench.models import PRESETS, quarter_pattern
from megatron_tc.model import HybridCache, HybridLM
import megatron_tc.model.gdn as gdn_mod

where = ["top"]
counts = collections.Counter(); names = collections.defaultdict(collections.Counter)
VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "expand", "as_strided",
         "split", "split_with_sizes", "alias", "detach", "reshape", "permute", "unbind", "_reshape_alias"}
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kind = "view" if name in VIEWS else "compute"
        counts[(where[-1], kind)] += 1
        names[where[-1]][name] += 1
        return func(*args, **(kwargs or {}))

orig = gdn_mod.gated_delta_rule
def rule(*a, **k):
    where.append("gdn_kernel"); 
    try: return orig(*a, **k)
    finally: where.pop()
gdn_mod.gated_delta_rule = rule

arch = PRESETS["smollm2-135m"]()
from dataclasses import replace
small = replace(arch, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)
model = HybridLM(small.with_pattern(quarter_pattern(small.num_layers))).eval()
for i, layer in enumerate(model.layers):
    tag = "A_layer" if layer.kind == "A" else "G_layer"
    layer.register_forward_pre_hook(lambda m, a, tag=tag: where.append(tag))
    layer.register_forward_hook(lambda m, a, o: (where.pop(), None)[1])
ids = torch.randint(0, 512, (1, 64))
with torch.no_grad():
    cache = HybridCache(model.arch)
    model(ids, cache=cache)
    tok = ids[:, -1:]
    model(tok, cache=cache)  # warm
    with Count():
        model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
nA, nG = model.arch.layer_kinds.count("A"), model.arch.layer_kinds.count("G")
print(f"pattern {model.arch.layer_pattern}: {nA} A, {nG} G")
for tag, n in (("A_layer", nA), ("G_layer", nG), ("gdn_kernel", nG), ("top", 1)):
    c, v = counts[(tag, "compute")] / n, counts[(tag, "view")] / n
    print(f"{tag:10s} per layer: {c:5.1f} compute ops + {v:5.1f} view ops;  top: {names[tag].most_common(12)}")
total_c = sum(v for (t, k), v in counts.items() if k == "compute")
total_v = sum(v for (t, k), v in counts.items() if k == "view")
print(f"whole step: {total_c} compute + {total_v} view aten ops (GDN kernel = PyTorch recurrent on CPU; on CUDA it is fla's fused recurrent)")
# wall time per step of this tiny model on this CPU (dispatch-bound)
with torch.no_grad():
    for _ in range(3): model(tok, cache=cache)
    t0 = time.perf_counter(); n = 20
    for _ in range(n): model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
    print(f"tiny model eager step on this CPU: {(time.perf_counter()-t0)/n*1e3:.2f} ms (load-dependent)")
