"""tools/bench/bos_perplexity.py: megatron_tc's perplexity of a teacher equals transformers' own loss
on the same windows, with and without a BOS token in front of each window."""
from __future__ import annotations

import json
import math

from tests._scripts import load_script


def test_both_window_kinds_match_transformers(tmp_path):
    from megatron_tc.testing import write_tiny_teacher

    root = write_tiny_teacher(tmp_path / "tiny", n_docs=1, words_per_doc=(300, 300))
    text = next((root / "text").iterdir())
    out = tmp_path / "bos.json"
    tool = load_script("tools/bench/bos_perplexity.py")
    assert tool.main(["--model", str(root / "teacher"), "--text", str(text), "--seq-len", "32",
                      "--max-tokens", "200", "--out", str(out)]) == 0
    rows = {r["windows"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bos", "no_bos"}
    assert [rows["bos"]["rule_picks"], rows["no_bos"]["rule_picks"]].count(True) == 1
    for row in rows.values():
        assert math.isfinite(row["ppl"]) and row["ppl"] > 1
        assert abs(row["rel_diff"]) < 1e-5 and row["tokens"] == row["transformers_tokens"]
    # BOS windows score every text token; plain windows leave each window's first one unscored
    assert rows["bos"]["tokens"] > rows["no_bos"]["tokens"]
