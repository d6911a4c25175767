"""The statistics pass: chunked sums == a direct full-matrix reference; file metadata checks."""
import math

import pytest
import torch

from megatron_tc.calibrate.moments import attention_sums, layer_input_sums, layers_input_sums
from megatron_tc.calibrate.statsfile import StatsMismatchError, TaylorStats, state_dict_sha256
from megatron_tc.model.ops import positions_from_doc_ids


def reference_sums(q, k, v, scale, o_weight, doc_ids, window):
    """Every statistic from the full T x T probability matrix, token by token, in fp64."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    pos = positions_from_doc_ids(doc_ids)
    out = {key: torch.zeros(hq, dtype=torch.float64) for key in
           ("dist", "entropy", "sink", "logit_var", "conc", "dist_nosink", "conc_nosink", "zero_order_err", "out_energy",
            "out_energy_o", "self", "y_rms")}
    o_heads = o_weight.double().view(o_weight.shape[0], hq, d)
    for bi in range(b):
        for ti in range(t):
            start = ti - int(pos[bi, ti])
            lo = start if window is None else max(start, ti - window + 1)
            js = torch.arange(lo, ti + 1)
            n = len(js)
            for h in range(hq):
                s = logits[bi, h, ti, js]
                p = torch.softmax(s, -1)
                y = p @ v[bi, h, js]
                dist = (ti - js).double()
                ent = float(-(p * p.log()).sum())
                out["dist"][h] += float((p * dist).sum())
                out["entropy"][h] += ent
                p_sink = float(p[0]) if lo == start else 0.0
                out["sink"][h] += p_sink
                out["logit_var"][h] += float(s.var(unbiased=False))
                out["zero_order_err"][h] += float((y - v[bi, h, js].mean(0)).pow(2).sum())
                out["out_energy"][h] += float(y.pow(2).sum())
                out["self"][h] += float(p[-1])  # the query's own key is the last visible one
                out["y_rms"][h] += float(y.pow(2).mean().sqrt())
                out["out_energy_o"][h] += float((o_heads[:, h] @ y).pow(2).sum())
                if n >= 2:
                    out["conc"][h] += 1 - ent / math.log(n)
                    keep = js != start
                    pn = p[keep] / p[keep].sum()
                    out["dist_nosink"][h] += float((pn * dist[keep]).sum())
                    n_ns = n - 1 if lo == start else n
                    if n_ns >= 2:
                        ent_n = float(-(pn * pn.log()).sum())
                        out["conc_nosink"][h] += 1 - ent_n / math.log(n_ns)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_sums_equal_full_matrix_reference(window):
    torch.manual_seed(1)
    b, hq, hkv, t, d = 2, 4, 2, 13, 8
    q, k, v = torch.randn(b, hq, t, d) * 2, torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    o_weight = torch.randn(16, hq * d)
    doc_ids = torch.tensor([[0] * 6 + [1] * 7, [3] * 13])
    got, y = attention_sums(q, k, v, 0.3, o_weight, doc_ids, window, chunk_size=4)
    want = reference_sums(q, k, v, 0.3, o_weight, doc_ids, window)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=2e-5, atol=2e-5, msg=f"statistic {key}")
    # chunking does not change anything
    again, y2 = attention_sums(q, k, v, 0.3, o_weight, doc_ids, window, chunk_size=13)
    for key in got:
        torch.testing.assert_close(got[key], again[key], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, y2)


def test_kv_and_output_moments():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 7, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4)
    got, y = attention_sums(q, k, v, 0.5, torch.randn(5, 8), None, None, chunk_size=3)
    torch.testing.assert_close(got["k_sum"], k.double().sum(dim=(0, 2)))
    torch.testing.assert_close(got["v_sq"][0], v[0, 0].double().T @ v[0, 0].double())
    torch.testing.assert_close(got["y_sq"][1], y[0, 1].double().T @ y[0, 1].double())
    counts = layer_input_sums(torch.randn(1, 7, 5), torch.randn(1, 7, 5), torch.randn(1, 7, 5), None, None)
    assert counts["count"] == 7 and counts["count2"] == 6 and counts["count3"] == 5


def test_moments_over_a_batch_and_layer_sums_equal_fp64_formulas():
    """k/v/y first and second moments summed over several rows, and the layer sums of a bf16 input
    with an fp32 residual stream, against the fp64 formulas."""
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 4, 9, 4), torch.randn(3, 2, 9, 4), torch.randn(3, 2, 9, 4)
    got, y = attention_sums(q, k, v, 0.5, torch.randn(5, 16), None, None, chunk_size=4)
    for name, x in (("k", k), ("v", v), ("y", y)):
        x64 = x.double()
        torch.testing.assert_close(got[f"{name}_sum"], x64.sum(dim=(0, 2)), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[f"{name}_sq"], torch.einsum("bhtd,bhte->hde", x64, x64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["out_energy"], y.double().pow(2).sum(dim=(0, 2, 3)), rtol=1e-12, atol=0)
    x, resid, out = torch.randn(2, 7, 5).bfloat16(), torch.randn(2, 7, 5) * 10, torch.randn(2, 7, 5).bfloat16()
    sums = layer_input_sums(x, resid, out, None, None)
    torch.testing.assert_close(sums["x_sum"], x.double().sum(dim=(0, 1)), rtol=1e-12, atol=1e-12)
    for key, value in (("x_energy", x), ("resid_energy", resid), ("Y_energy", out)):
        torch.testing.assert_close(sums[key], value.double().pow(2).sum(), rtol=1e-12, atol=0, msg=key)
    # several layers in one call: each layer's own sums
    layers = [(torch.randn(2, 7, 5).bfloat16(), torch.randn(2, 7, 5), torch.randn(2, 7, 5).bfloat16()) for _ in range(3)]
    stacked = layers_input_sums(*zip(*layers), doc_ids=torch.tensor([[0] * 3 + [1] * 4] * 2), sliding_window=4)
    for (x, resid, out), got in zip(layers, stacked):
        alone = layer_input_sums(x, resid, out, torch.tensor([[0] * 3 + [1] * 4] * 2), 4)
        assert got.keys() == alone.keys()
        for key in alone:
            torch.testing.assert_close(got[key], alone[key], rtol=1e-12, atol=0, msg=key)


def _stats(sha="a" * 64, layers=(1, 2)):
    sums = {f"layers.{l}.count": torch.tensor(4.0, dtype=torch.float64) for l in layers}
    return TaylorStats({"teacher_sha256": sha, "layers": list(layers), "layer_pattern": "AAA", "readout": {}}, sums)


def test_stats_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "stats.pt"
    _stats().save(path)
    loaded = TaylorStats.load(path, teacher_sha256="a" * 64, converted_layers=[1, 2])
    assert loaded.meta["layers"] == [1, 2] and float(loaded.sums["layers.1.count"]) == 4.0
    with pytest.raises(StatsMismatchError, match="computed for teacher aaaaaaaaaaaa"):
        TaylorStats.load(path, teacher_sha256="b" * 64)
    with pytest.raises(StatsMismatchError, match=r"layers \[0\] are converted"):
        TaylorStats.load(path, teacher_sha256="a" * 64, converted_layers=[0, 1])
    with pytest.raises(StatsMismatchError, match="no readout sums of strategy 'taylor'"):
        loaded.readout("taylor", 1)
    assert not list(tmp_path.glob(".stats.*")), "temporary file left behind"


def test_layer_and_readout_groups_follow_the_sums():
    """`layer` / `readout` name a layer's sums without their prefix (layer 1 never matches layer 12)
    and see sums added, replaced or removed after an earlier read."""
    one, two = torch.ones(2, dtype=torch.float64), torch.full((2,), 2.0, dtype=torch.float64)
    stats = TaylorStats({"layers": [1, 12]}, {"layers.1.count": one, "layers.12.count": two,
                                              "readout.taylor.layers.1.uy": two, "readout.taylor.layers.12.uy": one})
    assert stats.layer(1) == {"count": one} and stats.layer(12) == {"count": two}
    assert stats.readout("taylor", 12) == {"uy": one}
    stats.sums["layers.1.x_sum"] = two
    stats.sums["layers.12.count"] = one
    assert stats.layer(1) == {"count": one, "x_sum": two} and stats.layer(12)["count"] is one
    stats.sums.update({"readout.taylor_fit.layers.1.uy": one})
    assert stats.readout("taylor_fit", 1) == {"uy": one}
    del stats.sums["layers.12.count"]
    with pytest.raises(StatsMismatchError, match="not layer 12"):
        stats.layer(12)


def test_state_dict_hash_sees_every_weight():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    b = {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-6])}
    assert state_dict_sha256(a) == state_dict_sha256({k: v.clone() for k, v in a.items()})
    assert state_dict_sha256(a) != state_dict_sha256(b)


def test_sink_dominated_heads_keep_non_sink_statistics_exact():
    """A sink holding ~all the mass: sink-free distance/concentration and the logit variance still
    match the fp64 reference (non-sink sums are taken directly, never as total - sink, and the
    logit variance comes from the logits, not from log(probabilities) that underflow)."""
    torch.manual_seed(3)
    b, hq, hkv, t, d = 1, 2, 1, 40, 8
    q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    q[..., 0] += 6.0
    k[:, :, 0, 0] += 40.0  # logit of key 0 ~ 30 above the rest (and > 87 above some: p underflows)
    k[:, :, 0, 1:] = 0.0
    o_weight = torch.randn(16, hq * d)
    doc_ids = torch.zeros(b, t, dtype=torch.long)
    got, _ = attention_sums(q, k, v, 0.5, o_weight, doc_ids, None, chunk_size=16)
    want = reference_sums(q, k, v, 0.5, o_weight, doc_ids, None)
    assert float(want["sink"].min()) > 0.99 * (t - 1)  # the sink really dominates
    for key in ("dist_nosink", "conc_nosink", "logit_var", "dist", "entropy", "sink"):
        torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-5, msg=f"statistic {key}")
