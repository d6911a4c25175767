"""tools/bench/corpus_scale.py runs end to end with --quick on CPU: the loader over the store sees
every document and token the preprocessing wrote, the result is a table, the scratch is deleted
(no timing or memory asserted)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._scripts import load_script


@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="measures with /usr/bin/time")
def test_corpus_scale_quick(tmp_path):
    out = tmp_path / "corpus_scale.json"
    assert load_script("tools/bench/corpus_scale.py").main(["--quick", "--work", str(tmp_path / "work"),
                                                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "table" and len(result["rows"]) == 1 and len(result["rows"][0]) == len(result["columns"])
    run = result["measurements"][0]
    documents, tokens = map(int, re.search(r"(\d+) documents, (\d+) tokens", run["preprocess"]["stdout"]).groups())
    assert (run["loader"]["documents"], run["loader"]["tokens"]) == (documents, tokens) and documents > 20
    assert run["preprocess"]["peak_rss_mib"] > 0 and run["loader"]["rss_anon_mib"] > 0
    assert not (tmp_path / "work").exists()
