"""tools/bench/generate.py runs end to end with --quick on CPU and reports every case (no timing
asserted); each case starts from its own shape's state, and its timed prefill forward is the
model's forward over the prompt."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_tc.bench.generate import bench_decode, prefill_forward, student_model, teacher_model
from megatron_tc.bench.models import PRESETS
from tests._scripts import load_script


def test_quick_generate_benchmark_reports_teacher_and_student(tmp_path):
    out = tmp_path / "generate.json"
    assert load_script("tools/bench/generate.py").main(["--quick", "--profile", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["role"], r["batch"], r["prompt"]): r for r in data["rows"]}
    assert set(rows) == {(role, b, p) for role in ("teacher", "student") for b, p in ((2, 32), (1, 16))}
    for row in rows.values():
        assert "error" not in row, row
        assert 0 < row["decode_ms"]["min"] <= row["decode_ms"]["median"] <= row["decode_ms"]["max"]
        assert row["tokens_per_s"] > 0 and row["prefill_ms"]["median"] > 0
        assert 0 < row["prefill_forward_ms"]["min"] <= row["prefill_forward_ms"]["max"]
        assert row["prefill_new_length_ms"] > 0 and row["prefill_new_length_generate_ms"] > 0
        total = row["prefill_profile"][0]
        assert total["op"] == "(all)" and total["calls"] > 0 and total["host_ms"] > 0
    assert rows[("student", 2, 32)]["captured_step"] is False  # CPU: no CUDA graph


def test_eager_rounds_alternate_teacher_and_student_and_leave_the_prefill_graphs_setting(tmp_path, monkeypatch):
    """--eager-rounds times only the prefill of a prompt with no whole-model graph: per prompt length
    one row with the spreads over the rounds and the per-round speed-ups; the student's eager
    prefills run with capture off, its first-prompt ones with capture on and no graph kept from an
    earlier call, its replays with the graphs of the call before; its setting is restored afterwards."""
    import megatron_tc.bench.generate as generate

    script = load_script("tools/bench/generate.py")
    seen, real = [], generate.prefill_forward

    def recording(model, ids, length):
        graphs = getattr(model, "_prefills", None)
        kept = None if graphs is None else (len(graphs.graphs) + len(graphs.counts), len(graphs.layers.shapes))
        seen.append((type(model).__name__, getattr(model, "prefill_graph_tokens", None), kept, length))
        out = real(model, ids, length)
        if graphs is not None:  # what captures leave behind (none on CPU)
            graphs.counts[("stand-in",)] = 1
            graphs.layers.shapes[("stand-in",)] = {}
        return out

    monkeypatch.setattr(generate, "prefill_forward", recording)
    students = []
    monkeypatch.setattr(script, "student_model", lambda *a: students.append(generate.student_model(*a)) or students[-1])
    out = tmp_path / "eager.json"
    assert script.main(["--quick", "--eager-rounds", "3", "--out", str(out)]) == 0  # a 16-token prompt, 8 new
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt"], r["rounds"], r["model"]) for r in rows] == [(16, 3, "tiny")]
    for row in rows:
        for key in ("teacher_ms", "student_ms", "student_first_ms", "student_replay_ms", "speedup", "speedup_first",
                    "speedup_replay"):
            assert 0 < row[key]["min"] <= row[key]["median"] <= row[key]["max"], (key, row)
    # 2 warm-up rounds, then 3: teacher, student eager, first prompt, replay; the cache holds the
    # prompt + the new tokens
    student = "MegatronTCForCausalLM"
    assert [name for name, *_ in seen] == ["LlamaForCausalLM", student, student, student] * 5
    assert {length for *_, length in seen} == {24}
    tokens = students[0].prefill_graph_tokens
    assert tokens > 0
    assert {(graphs, kept) for _, graphs, kept, _ in seen[2::4]} == {(tokens, (0, 0))}  # nothing kept
    assert {(graphs, kept) for _, graphs, kept, _ in seen[3::4]} == {(tokens, (0, 1))}  # the layer graphs kept
    assert {graphs for _, graphs, _, _ in seen[1::4]} == {0}


def test_each_case_sizes_the_teacher_static_cache_for_its_own_prompt():
    """transformers keeps the longest static cache length across generate calls; a short case run
    after a long one must not inherit it (it would attend over the long case's slots)."""
    torch.manual_seed(0)
    arch = PRESETS["tiny"]()
    model = teacher_model(arch, torch.device("cpu"), torch.float32)
    new = 3
    for batch, prompt in ((2, 32), (1, 12)):
        bench_decode(model, {"cache_implementation": "static"}, batch, prompt, new, 1, 0, arch.vocab_size,
                     torch.device("cpu"))
    assert model._previous_max_cache_length == 12 + new - 1


def test_prefill_forward_matches_an_uncached_forward():
    """The timed prefill (fresh static cache, last token's logits) computes the same logits as a
    plain forward over the prompt, for the student and for the teacher."""
    torch.manual_seed(0)
    arch = PRESETS["tiny"]()
    ids = torch.randint(3, arch.vocab_size, (2, 20))
    for build in (student_model, teacher_model):
        model = build(arch, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False).logits[:, -1:]
        logits = prefill_forward(model, ids, 24)
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_cases_after_an_out_of_memory_error_are_reported_skipped(tmp_path, monkeypatch):
    """After one case of a role runs out of memory, its later cases in the process are not run (a
    compiled step fails again once its graph pool broke) but reported, and the other role runs."""
    from megatron_tc.bench import generate as bench_generate

    script = load_script("tools/bench/generate.py")
    real, calls = bench_generate.bench_decode, []

    def first_teacher_case_oom(model, kwargs, batch, prompt, *args):
        calls.append((type(model).__name__, batch, prompt))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(model, kwargs, batch, prompt, *args)

    monkeypatch.setattr(bench_generate, "bench_decode", first_teacher_case_oom)
    out = tmp_path / "generate.json"
    assert script.main(["--quick", "--out", str(out)]) == 0  # cases (B=2, 32 tokens), (B=1, 16)
    rows = {(r["role"], r["batch"], r["prompt"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("teacher", 2, 32)]["error"].startswith("out of memory: CUDA out of memory")
    assert rows[("teacher", 1, 16)]["error"] == bench_generate.OOM_SKIP
    assert all("error" not in rows[("student", b, p)] for b, p in ((2, 32), (1, 16)))
    assert len(calls) == 3  # the teacher's first case, then the student's two


def test_layer_graph_elements_sets_the_export_s_limit_and_rejects_a_negative_one(monkeypatch, capsys):
    from megatron_tc.export import graphs_megatron_tc as graphs

    monkeypatch.setattr(graphs, "LAYER_GRAPH_ELEMENTS", graphs.LAYER_GRAPH_ELEMENTS)  # restored afterwards
    script = load_script("tools/bench/generate.py")
    with pytest.raises(SystemExit):
        script.main(["--quick", "--eager-rounds", "1", "--layer-graph-elements", "-1"])
    assert "--layer-graph-elements must be 0 or more, got -1" in capsys.readouterr().err
    assert script.main(["--quick", "--eager-rounds", "1", "--layer-graph-elements", "12345"]) == 0
    assert graphs.LAYER_GRAPH_ELEMENTS == 12345


def test_eager_rounds_with_profile_add_each_role_s_operators_by_host_time(tmp_path):
    out = tmp_path / "profile.json"
    assert load_script("tools/bench/generate.py").main(["--quick", "--eager-rounds", "1", "--profile", "--out",
                                                        str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["profile"]) == {"teacher", "student_first", "student_replay"}
    for ops in row["profile"].values():
        total, *top = ops
        assert total["op"] == "(all)" and total["calls"] > 0 and total["host_ms"] > 0
        assert top and [op["host_ms"] for op in top] == sorted((op["host_ms"] for op in top), reverse=True)


def test_profile_rows_refuse_an_unknown_order():
    from megatron_tc.bench.common import profile_rows

    with pytest.raises(ValueError, match="orders by 'device' or 'host' time, not 'wall'"):
        profile_rows(lambda: None, torch.device("cpu"), by="wall")
