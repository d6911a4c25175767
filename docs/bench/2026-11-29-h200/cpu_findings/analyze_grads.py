import os, sys, torch, math
OUTDIR = os.environ.get("FINDINGS_DIR", "/tmp")
pre, T = sys.argv[1], sys.argv[2]
load = lambda m: torch.load(f"{OUTDIR}/grads_{pre}_{T}_{m}.pt", weights_only=False)
f64 = load("f64"); ref = load("ref")
def rel(a, b): return float((a - b).norm() / b.norm())
def table(name, test, base):
    lt, gt, pt = test; lb, gb, pb = base
    errs = {n: rel(gt[n], g) for n, g in gb.items() if g.norm() > 0}
    gnorm = math.sqrt(sum(float(g.norm())**2 for g in gb.values()))
    diff = math.sqrt(sum(float((gt[n]-g).norm())**2 for n, g in gb.items()))
    worst = sorted(errs, key=errs.get, reverse=True)[:6]
    med = sorted(errs.values())[len(errs)//2]
    print(f"{name}: loss rel {abs(lt-lb)/abs(lb):.2e}  global grad rel {diff/gnorm:.2e}  median per-tensor {med:.3f}  max {errs[worst[0]]:.3f}")
    for n in worst:
        print(f"   {n:40s} rel {errs[n]:.3f}  |g|/|g_all| {float(gb[n].norm())/gnorm:.1e}  |diff|/|g_all| {float((gt[n]-gb[n]).norm())/gnorm:.1e}")
    # by parameter kind
    kinds = {}
    for n, e in errs.items():
        k = ".".join(p for p in n.split(".") if not p.isdigit())
        kinds.setdefault(k, []).append(e)
    print("   per kind (median):", ", ".join(f"{k.replace('layers.','')}={sorted(v)[len(v)//2]:.3f}" for k, v in sorted(kinds.items())))
    return errs
table("fp32 ref vs f64", ref, f64)
for m in sys.argv[3].split(","):
    table(f"{m} vs fp32 ref", load(m), ref)
# cancellation in dt_bias / b_proj.bias: per token pre-activation grads
_, g_ref, p_ref = ref
for m in sys.argv[3].split(","):
    _, g_t, p_t = load(m)
    rows = []
    for i in sorted(p_ref):
        for j, nm in ((0, "dt_bias"), (1, "b_proj.bias")):
            r, t = p_ref[i][j][0], p_t[i][j][0]   # [T, H]
            summed = r.sum(0); absum = r.abs().sum(0)
            canc = float(absum.norm() / summed.norm())
            tok_err = rel(t, r)   # per-token gradient error
            sum_err = rel(t.sum(0), summed)
            rows.append((i, nm, canc, tok_err, sum_err))
    worst = sorted(rows, key=lambda r: -r[4])[:4]
    print(f"{m}: pre-activation grads (z = a_proj x + dt_bias; b_proj x + b): cancellation ||sum|dz_t|||/||sum dz_t||, per-token rel err, summed rel err")
    for r in worst: print(f"   layer {r[0]:2d} {r[1]:12s} cancellation {r[2]:7.1f}  per-token err {r[3]:.3f}  sum err {r[4]:.3f}")
    allc = sorted(r[2] for r in rows); print(f"   cancellation median {allc[len(allc)//2]:.1f}, per-token err median {sorted(r[3] for r in rows)[len(rows)//2]:.3f}")
