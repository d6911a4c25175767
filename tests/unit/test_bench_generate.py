"""tools/bench/generate.py runs end to end with --quick on CPU and reports every case (no timing asserted)."""
from __future__ import annotations

import json

from tests._scripts import load_script


def test_quick_generate_benchmark_reports_teacher_and_student(tmp_path):
    out = tmp_path / "generate.json"
    assert load_script("tools/bench/generate.py").main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["role"], r["batch"], r["prompt"]): r for r in data["rows"]}
    assert set(rows) == {(role, b, p) for role in ("teacher", "student") for b, p in ((2, 32), (1, 16))}
    for row in rows.values():
        assert "error" not in row, row
        assert 0 < row["decode_ms"]["min"] <= row["decode_ms"]["median"] <= row["decode_ms"]["max"]
        assert row["tokens_per_s"] > 0 and row["prefill_ms"]["median"] > 0
    assert rows[("student", 2, 32)]["captured_step"] is False  # CPU: no CUDA graph
