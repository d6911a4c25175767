"""The benchmark scripts run end to end with --quick on CPU and write what they claim.

Each script runs in-process (main(argv)) to share one torch import; the assertions check the
numbers that must hold on any machine: reference errors of fp32 paths, cache sizes against the
formula, FLOP counts against the model's own parameters. No timing is asserted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_tc.bench.models import forward_flops, matmul_params, quarter_pattern, tiny
from megatron_tc.bench.summary import summarize
from megatron_tc.calibrate.graphs import GRAPHS_ENV
from megatron_tc.model import HybridLM
from tests._scripts import load_script


def load_tool(name: str):
    """`load_tool("bench_train")`: tools/bench/train.py as a fresh module."""
    return load_script(f"tools/bench/{name.removeprefix('bench_')}.py")


def run(name: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert load_tool(name).main(["--quick", "--out", str(out), *extra]) == 0
    data = json.loads(out.read_text())
    assert data["errors"] == [], data["errors"]
    assert out.with_suffix(".md").read_text().startswith("## ")
    return data


def test_matmul_params_match_the_model():
    arch = tiny().with_pattern(quarter_pattern(4))
    model = HybridLM(arch)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = arch.vocab_size * arch.hidden_size if arch.tie_embeddings else 0
    assert matmul_params(arch) == linear + head
    assert arch.layer_pattern == "AGGG"  # uniform keeps layer 0 and every k-th


def test_bench_gdn_quick(tmp_path):
    data = run("bench_gdn", tmp_path, "--chunk-max-t", "128")
    assert {c["method"] for c in data["checks"]} == {"torch-chunk", "sdpa"}  # no fla on CPU
    assert all(c["max_rel_err"] < 1e-5 for c in data["checks"])  # fp32 against float64
    skipped = [r for r in data["rows"] if "note" in r]
    assert skipped and all(r["method"] == "torch-chunk" and r["T"] > 128 for r in skipped)
    assert all(r["ms"] > 0 for r in data["rows"] if "note" not in r)


def test_bench_inference_quick(tmp_path):
    data = run("bench_inference", tmp_path)
    assert all(c["rel_err"] < 1e-4 for c in data["checks"])  # cached decoding == full forward (fp32)
    assert all(c["rel_err_fp32"] < 1e-4 and c["bf16_vs_fp32"] < 1e-6 for c in data["checks"])  # fp32 on CPU
    arch = tiny()
    for row in data["prefill"]:
        n_attn = row["pattern"].count("A")
        assert row["kv_bytes"] == n_attn * 2 * arch.num_kv_heads * row["T"] * arch.head_dim * 4
        assert row["state_bytes"] == (arch.num_layers - n_attn) * arch.num_heads * arch.head_dim**2 * 4
    assert {r["role"] for r in data["decode"]} == {"teacher", "student"}
    assert any(r["metric"].startswith("decode") for r in data["summary"])


def test_bench_inference_decode_profile(tmp_path):
    data = run("bench_inference", tmp_path, "--roles", "student", "--profile-decode", "--sdpa-backend", "math",
               "--decode-batches", "1")
    assert {r["role"] for r in data["decode"]} == {"student"}
    (row,) = data["decode"]
    assert row["aten_calls_per_step"] > 0
    assert data["decode_profile"] and all(r["self_cpu_ms_per_step"] >= 0 for r in data["decode_profile"])


def test_bench_train_quick(tmp_path):
    data = run("bench_train", tmp_path, "--profile")  # default --variants reference,chunked-loss,fused: a row each
    assert [(r["variant"], r["loss_impl"]) for r in data["rows"]] == [("reference", "reference"),
                                                                       ("chunked-loss", "chunked"),
                                                                       ("fused", "chunked")]
    for row in data["rows"]:
        assert row["finite"] and row["mfu"] > 0
        student, teacher = tiny().with_pattern(quarter_pattern(4)), tiny()
        tokens = row["B"] * row["T"]
        expected = 3 * forward_flops(student, tokens, row["T"]) + forward_flops(teacher, tokens, row["T"])
        assert row["flops"] == pytest.approx(expected / 1e12)
        assert row["busy_ms"] > 0
    assert {r["variant"] for r in data["profile"]} == {"reference", "chunked-loss", "fused"}
    (check,) = data["checks"]  # on CPU both sides run the PyTorch chunked backend in fp32
    assert check["grad_rel_err_global"] < 1e-6 and check["loss_rel_err"] < 1e-6
    assert check["chunked_vs_reference_loss_rel_err"] < 1e-5
    assert check["chunked_vs_reference_grad_rel_err_global"] < 1e-5
    assert check["compiled_vs_eager_grad_rel_err_global"] == 0  # CPU: the model blocks run eagerly either way


def test_gradient_errors_global_and_per_tensor():
    """A tensor with a tiny gradient doubled: per-tensor error 1.0, global error tiny."""
    from megatron_tc.bench.train_check import grad_errors as errors
    ref = {"w": torch.tensor([3.0, 4.0]), "dt_bias": torch.tensor([0.0, 1e-3])}
    out = errors({"w": ref["w"].clone(), "dt_bias": 2 * ref["dt_bias"]}, ref)
    assert out["worst_param"] == "dt_bias" and out["max_grad_rel_err"] == pytest.approx(1.0)
    assert out["grad_rel_err_global"] == pytest.approx(1e-3 / 5, rel=1e-6)
    assert out["worst_param_err_vs_global_norm"] == pytest.approx(1e-3 / 5, rel=1e-6)


def test_bench_stats_quick(tmp_path):
    data = run("bench_stats", tmp_path, "--profile")
    (check,) = data["checks"]
    assert check["max_rel_err"] < 1e-6  # fp32 on CPU against the fp32 CPU reference
    passes = [r["pass"] for r in data["rows"]]
    assert passes[0] == "teacher forward" and passes[-2:] == ["statistics pass (both sweeps)",
                                                               "statistics pass, one forward (collect_stats)"]
    (calib,) = data["calibrate"]
    assert calib["wall_s"] > 0 and calib["converted_layers"] == 3
    phases = {"sweep 1": ["stats.sweep1.finish", "stats.sweep1.sums"],
              "sweep 2": ["stats.sweep2.closed_form", "stats.sweep2.finish", "stats.sweep2.sums"]}
    phases["collect_stats"] = phases["sweep 1"] + phases["sweep 2"]
    for name, ranges in phases.items():  # all operators, the heaviest (host time on CPU), the phases
        total, *ops = [row for row in data["profile"] if row["pass"] == name and "op" in row]
        assert total["op"] == "(all)" and len(ops) == 12 and total["device_ms"] == 0
        assert all(0 < op["host_ms"] <= total["host_ms"] and op["calls"] <= total["calls"] for op in ops)
        assert [op["host_ms"] for op in ops] == sorted((op["host_ms"] for op in ops), reverse=True)
        assert not any(op["op"].startswith("stats.") for op in ops), "a phase's range listed as an operator"
        spans = {row["range"]: row for row in data["profile"] if row["pass"] == name and "range" in row}
        assert sorted(spans) == ranges
        assert all(row["calls"] >= 1 and row["host_ms"] > 0 and row["device_ms"] == 0 for row in spans.values())
    calls = {row["range"]: row["calls"] for row in data["profile"] if row["pass"] == "sweep 2" and "range" in row}
    assert calls["stats.sweep2.closed_form"] == 1  # the two-forward sweep builds its 3 layers' mixers at once
    assert "syncs" not in data  # the host's waits for a device are counted on CUDA only
    assert "bench_stats" in summarize(tmp_path)


def test_bench_stats_preset_picks_the_teacher_shape(tmp_path):
    """--preset (without --quick) builds the teacher of that shape: tiny's quarter pattern converts 3
    of its 4 layers, where the default SmolLM2 shape converts 22."""
    out = tmp_path / "stats.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "1", "--seq", "32", "--num-batches", "1",
            "--chunk-size", "16", "--readout", "", "--no-calibrate", "--budget-ms", "10", "--out", str(out)]
    assert load_tool("bench_stats").main(argv) == 0
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["notes"] == ["teacher: random weights of the tiny shape"]
    assert {row["layers"] for row in data["rows"]} == {3} and data["pattern"] == quarter_pattern(4)


def test_device_busy_time_counts_overlapping_spans_once():
    from megatron_tc.bench.common import covered

    assert covered([]) == 0
    assert covered([(5.0, 7.0)]) == 2.0
    assert covered([(0.0, 4.0), (1.0, 2.0), (3.0, 6.0), (10.0, 11.0)]) == 7.0  # nested, overlapping, apart
    assert covered([(10.0, 11.0), (0.0, 1.0), (1.0, 3.0)]) == 4.0  # unsorted, touching


def test_bench_stats_phases(tmp_path, monkeypatch):
    """--phases: one row per variant in one process; the pass's two sweeps are timed inside it (their
    sum within its total), the JSON holds every round as it ends (a run cut short keeps them), and
    the statistics module is left as it was."""
    from megatron_tc.bench.common import Report
    from megatron_tc.calibrate import stats as stats_module

    from megatron_tc.calibrate import readout_mixers

    originals = (stats_module.collect_attention_stats, stats_module.collect_readout_stats,
                 stats_module.readout_stacked_layers, stats_module.readout_windows, readout_mixers.NARROW_DTYPES)
    graphs_env = os.environ.get(GRAPHS_ENV)
    saved_rounds, save = [], Report.save

    def saving(self):
        saved_rounds.append({row["repeats"] for row in self.data.get("phases", [])})
        save(self)

    monkeypatch.setattr(Report, "save", saving)
    data = run("bench_stats", tmp_path, "--phases", "2")
    assert [rounds for rounds in saved_rounds if rounds][:2] == [{1}, {2}]
    rows = {row["pass"]: row for row in data["phases"]}
    assert list(rows) == ["teacher forward", "collect_stats", "collect_stats, CUDA graphs",
                          "collect_stats, a readout call per layer", "collect_stats, groups of the cap",
                          "collect_stats, fp32 projections",
                          "sweep 1 alone", "sweep 1, layer I/O kept", "sweep 1, a call per layer"]
    assert not data.get("rows") and not data.get("calibrate")
    median = lambda cell: float(cell.split(" ")[0])  # noqa: E731 - "median (min-max)"
    for name in [name for name in rows if name.startswith("collect_stats")]:
        parts = median(rows[name]["sweep 1 ms"]) + median(rows[name]["sweep 2 ms"])
        assert 0 < parts <= median(rows[name]["ms"]) * 1.01 + 0.2  # the medians of parts and whole (0.1 ms rounding)
    assert all(row["repeats"] == 2 and row["ratio"] > 0 for row in rows.values())
    assert (stats_module.collect_attention_stats, stats_module.collect_readout_stats,
            stats_module.readout_stacked_layers, stats_module.readout_windows,
            readout_mixers.NARROW_DTYPES) == originals
    assert os.environ.get(GRAPHS_ENV) == graphs_env


def test_bench_stats_calibrate_only(tmp_path):
    data = run("bench_stats", tmp_path, "--calibrate-only")
    (calib,) = data["calibrate"]
    assert calib["wall_s"] > 0 and calib["align_steps"] == 3 and not data.get("rows") and not data.get("checks")


def test_bench_stats_calibrate_only_with_packed_documents(tmp_path):
    from megatron_tc.bench.stats_run import packed_batches

    batches = packed_batches(100, rows=8, seq=32, mean_doc=12, device="cpu")
    assert [b["doc_ids"].shape for b in batches] == [(1, 32)] * 8
    docs = [int(b["doc_ids"].max()) + 1 for b in batches]
    assert all(b["doc_ids"][0, 0] == 0 for b in batches) and max(docs) > 1  # boundaries, counted per row
    data = run("bench_stats", tmp_path, "--calibrate-only", "--packed-docs", "12")
    (calib,) = data["calibrate"]
    assert calib["wall_s"] > 0 and calib["docs"] == "packed, mean 12" and calib["mean_best_rel_mse"] > 0


def test_unknown_preset_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown model preset 'gpt9'"):
        load_tool("bench_inference").main(["--quick", "--models", "gpt9", "--out", str(tmp_path / "x.json")])


def test_bench_stats_kernel_configs_refuse_bad_shapes_and_a_cpu(tmp_path):
    tool = load_tool("bench_stats")
    with pytest.raises(SystemExit, match="write B,H,HKV,T,D"):
        tool.main(["--kernel-configs", "--kernel-shapes", "4,9,3,2048"])
    with pytest.raises(SystemExit, match=r"H \(9\) must be a multiple of HKV \(2\)"):
        tool.main(["--kernel-configs", "--kernel-shapes", "4,9,2,2048,64"])
    with pytest.raises(SystemExit, match="needs CUDA and triton"):
        tool.main(["--kernel-configs", "--device", "cpu", "--out", str(tmp_path / "k.json")])
