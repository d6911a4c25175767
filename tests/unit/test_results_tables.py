"""The results pages' tables are generated from the curated result files and stay equal to them."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_tc.eval import results_tables as rt

ROOT = Path(__file__).resolve().parents[2]
META = {"date": "2026-01-01", "hardware": "one test GPU", "software": {"torch": "x"}, "config": "configs/c.yaml",
        "command": "python tools/paper/grid.py grid", "bos": False}


def _run(init, seed, points, budget="grid"):
    tokens, ppl = zip(*points)
    return {"init": init, "seed": seed, "budget": budget, "config": "c.yaml",
            "curve": {"tokens": list(tokens), "ppl": list(ppl), "kl": [p / 100 for p in ppl]}}


def _grid_doc():
    # teacher 20: the 1.10x target is 22
    return {"kind": "tokens_to_target", "what": "w", **META, "teacher": "t", "policy": "uniform",
            "teacher_ppl": 20.0, "targets_x_teacher": [1.10],
            "runs": [_run("naive", 0, [(0, 900.0), (1000, 100.0), (8000, 30.0)]),
                     {"init": "zero_gate", "seed": 0, "budget": "grid", "config": "c.yaml",
                      "zero_shot": {"ppl": 950.0, "kl": 9.5}},
                     _run("taylor_calibrate", 0, [(0, 40.0), (1000, 24.0), (8000, 21.0)]),
                     _run("taylor_calibrate", 1, [(0, 42.0), (1000, 23.0), (8000, 21.5)]),
                     _run("taylor_fit", 0, [(0, 30.0), (1000, 22.0), (8000, 20.5)]),
                     _run("taylor_fit", 1, [(0, 32.0), (1000, 23.0), (8000, 20.8)]),
                     _run("naive", 0, [(0, 900.0), (8000, 30.0), (64000, 21.0)], budget="long")]}


def _crossing(t0, p0, t1, p1, target):
    """Independent of the package: log(ppl) linear in log(tokens) between the two points."""
    f = (math.log(p0) - math.log(target)) / (math.log(p0) - math.log(p1))
    return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))


def _setup(tmp_path, docs):
    results = tmp_path / "results"
    results.mkdir()
    for name, doc in docs.items():
        (results / f"{name}.json").write_text(json.dumps(doc))
    page = tmp_path / "page.md"
    page.write_text("Intro kept.\n\n" + "\n\n".join(f"<!-- results:{n} -->\n<!-- /results:{n} -->"
                                                    for n in rt.blocks(rt.load_results(results))) + "\n\nOutro kept.\n")
    return results, page


def test_the_committed_pages_equal_what_the_result_files_say(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert rt.main(["--check"]) == 0
    pages = "".join(p.read_text() for p in [*sorted(Path("docs").glob("*.md")), Path("README.md")])
    unpublished = [n for n in rt.blocks(rt.load_results(Path("docs/results"))) if f"<!-- results:{n} -->" not in pages]
    assert unpublished == [], f"result files with no table on any page: {unpublished}"


def test_tables_follow_the_numbers_and_a_changed_number_is_caught(tmp_path, capsys):
    results, page = _setup(tmp_path, {"grid_t_uniform": _grid_doc()})
    assert rt.main(["--results", str(results), "--page", str(page), "--no-figures"]) == 0
    text = page.read_text()
    assert text.startswith("Intro kept.") and text.rstrip().endswith("Outro kept.")
    tc = [_crossing(1000, 24.0, 8000, 21.0, 22.0), _crossing(1000, 23.0, 8000, 21.5, 22.0)]
    tf = [1000.0, _crossing(1000, 23.0, 8000, 20.8, 22.0)]
    long_naive = _crossing(8000, 30.0, 64000, 21.0, 22.0)
    mean_tc, mean_tf = sum(tc) / 2, sum(tf) / 2
    row = next(line for line in text.splitlines() if line.startswith("| uniform | 1.10x teacher"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:4] == ["not reached", rt.fmt_tokens(long_naive)]
    assert cells[4:6] == [rt.fmt_tokens(mean_tc), rt.fmt_tokens(mean_tf)]
    assert cells[6] == f"{long_naive / mean_tf:.2f}x"
    assert cells[7] == f"{mean_tc / mean_tf:.2f}x ({min(a / b for a, b in zip(tc, tf)):.2f}–" \
                       f"{max(a / b for a, b in zip(tc, tf)):.2f}x per seed)"
    assert "| uniform | taylor_fit | 8k | 2 | 31 (30–32) | 0.31 (0.3–0.32) | 20.65 (20.5–20.8) |" in text
    assert "| uniform | zero_gate | zero-shot only | 1 | 950 | 9.5 | — | — |" in text
    assert "Command: `python tools/paper/grid.py grid`" in text
    assert rt.main(["--results", str(results), "--page", str(page), "--check"]) == 0

    doc = _grid_doc()
    doc["runs"][4]["curve"]["ppl"][1] = 21.9  # taylor_fit seed 0 now reaches 22 earlier
    (results / "grid_t_uniform.json").write_text(json.dumps(doc))
    assert rt.main(["--results", str(results), "--page", str(page), "--check"]) == 1
    assert f"error: {page} is out of date" in capsys.readouterr().err


def test_a_plain_table_is_written_as_it_is(tmp_path):
    doc = {"kind": "table", "what": "w", **META, "columns": ["T", "ms"], "rows": [[4096, 22.49], [32768, "n/a"]]}
    results, page = _setup(tmp_path, {"bench_x": doc})
    assert rt.main(["--results", str(results), "--page", str(page), "--no-figures"]) == 0
    assert "| T | ms |\n|---|---|\n| 4096 | 22.49 |\n| 32768 | n/a |" in page.read_text()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("command"), "missing command"),
    (lambda d: d.update(kind="log"), "kind 'log' is unknown"),
])
def test_a_bad_result_file_is_refused_with_what_to_fix(tmp_path, capsys, change, message):
    doc = {"kind": "table", "what": "w", **META, "columns": ["a"], "rows": [[1]]}
    results, page = _setup(tmp_path, {"bench_x": doc})
    change(doc)
    (results / "bench_x.json").write_text(json.dumps(doc))
    assert rt.main(["--results", str(results), "--page", str(page), "--no-figures"]) == 2
    assert message in capsys.readouterr().err


def test_a_marker_without_a_result_file_is_refused(tmp_path, capsys):
    doc = {"kind": "table", "what": "w", **META, "columns": ["a"], "rows": [[1]]}
    results, page = _setup(tmp_path, {"bench_x": doc})
    page.write_text(page.read_text() + "\n<!-- results:bench_gone -->\n<!-- /results:bench_gone -->\n")
    assert rt.main(["--results", str(results), "--page", str(page), "--check"]) == 2
    assert "block 'results:bench_gone' names no result file" in capsys.readouterr().err


def test_figures_are_small_pngs(tmp_path):
    results, _ = _setup(tmp_path, {"grid_t_uniform": _grid_doc()})
    [png] = rt.write_figures(rt.load_results(results), tmp_path / "assets")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 60_000
