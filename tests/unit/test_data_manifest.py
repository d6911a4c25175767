"""Split manifest: deterministic, disjoint calibration/train/eval sets recorded in the run
directory; a changed document or split setting is refused when the run directory is reused."""
import json
import random

import pytest

from megatron_tc.data import (
    MANIFEST_NAME,
    SPLITS,
    DataError,
    Document,
    Manifest,
    SplitConfig,
    assign_splits,
    dedupe_documents,
    load_or_create_manifest,
)


def _docs(n: int) -> list[Document]:
    return [Document(f"doc{i:03d}", f"text of document {i}\n" * (i % 5 + 1)) for i in range(n)]


def test_splits_are_disjoint_complete_and_deterministic():
    names = [d.name for d in _docs(50)]
    cfg = SplitConfig(seed=3, calibration_fraction=0.1, eval_fraction=0.2)
    a = assign_splits(names, cfg)
    assert [len(a[s]) for s in SPLITS] == [5, 35, 10]
    assert sorted(sum(a.values(), [])) == sorted(names)
    shuffled = names[:]
    random.Random(1).shuffle(shuffled)
    assert assign_splits(shuffled, cfg) == a  # independent of load order
    assert assign_splits(names, SplitConfig(seed=4, calibration_fraction=0.1, eval_fraction=0.2)) != a
    # the calibration set does not move when only the eval fraction changes
    assert assign_splits(names, SplitConfig(seed=3, calibration_fraction=0.1, eval_fraction=0.3))["calibration"] \
        == a["calibration"]


def test_explicit_names_and_small_corpora():
    names = [d.name for d in _docs(10)]
    a = assign_splits(names, SplitConfig(calibration_docs=["doc001"], eval_docs=["doc002", "doc003"],
                                         calibration_fraction=0.5))
    assert a["calibration"] == ["doc001"] and a["eval"] == ["doc002", "doc003"] and len(a["train"]) == 7
    tiny = assign_splits(names[:3], SplitConfig(calibration_fraction=0.01, eval_fraction=0.01))
    assert [len(tiny[s]) for s in SPLITS] == [1, 1, 1]  # a positive fraction gets at least one
    with pytest.raises(DataError, match="no document is left for training"):
        assign_splits(names[:2], SplitConfig(calibration_fraction=0.01, eval_fraction=0.01))
    with pytest.raises(DataError, match="not in the source: \\['nope'\\]"):
        assign_splits(names, SplitConfig(eval_docs=["nope"]))
    with pytest.raises(DataError, match="both for calibration and eval"):
        assign_splits(names, SplitConfig(eval_docs=["doc001"], calibration_docs=["doc001"]))
    with pytest.raises(DataError, match="eval_fraction"):
        assign_splits(names, SplitConfig(eval_fraction=1.5))


def test_manifest_is_written_and_reuse_checks_documents_and_settings(tmp_path):
    docs, cfg = _docs(20), SplitConfig(seed=9)
    m = load_or_create_manifest(tmp_path, docs, cfg, source={"kind": "text"})
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    entry = on_disk["splits"]["train"][0]
    assert set(entry) == {"name", "sha256", "chars"}
    assert entry["sha256"] == next(d.sha256 for d in docs if d.name == entry["name"])
    assert on_disk["summary"]["eval"]["documents"] == len(m.names("eval"))
    again = load_or_create_manifest(tmp_path, list(reversed(docs)), cfg)
    assert all(again.names(s) == m.names(s) for s in SPLITS)
    victim = m.names("eval")[0]
    changed = [Document(d.name, d.text + "!") if d.name == victim else d for d in docs]
    with pytest.raises(DataError, match=f"changed 1 \\({victim}\\)"):
        load_or_create_manifest(tmp_path, changed, cfg)
    with pytest.raises(DataError, match="missing 1"):
        load_or_create_manifest(tmp_path, docs[1:], cfg)
    with pytest.raises(DataError, match="new 1 \\(zzz\\)"):
        load_or_create_manifest(tmp_path, docs + [Document("zzz", "new text")], cfg)
    with pytest.raises(DataError, match="other split settings"):
        load_or_create_manifest(tmp_path, docs, SplitConfig(seed=10))


def test_overlap_between_splits_is_detected(tmp_path):
    m = Manifest.create(_docs(10), SplitConfig(seed=1))
    m.entries["eval"].append(dict(m.entries["train"][0]))
    with pytest.raises(DataError, match="in both the train and the eval split"):
        m.check_disjoint()
    m = Manifest.create(_docs(10), SplitConfig(seed=1))
    m.entries["eval"][0]["sha256"] = m.entries["train"][0]["sha256"]
    with pytest.raises(DataError, match="same text as a train document"):
        m.check_disjoint()
    m.save(tmp_path / "m.json")
    with pytest.raises(DataError, match="same text"):
        Manifest.load(tmp_path / "m.json")


def test_dedupe_keeps_first_copy():
    docs = [Document("a", "same"), Document("b", "other"), Document("c", "same")]
    kept, dropped = dedupe_documents(docs)
    assert [d.name for d in kept] == ["a", "b"] and dropped == ["c"]
