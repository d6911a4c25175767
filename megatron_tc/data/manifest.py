"""Which documents are calibration, training and evaluation text, recorded in the run directory.

Assignment is by document *name*: each name gets a key sha256("<seed>:<name>"); documents sorted by
key are cut into calibration, then eval, then train. Explicit names pin documents to calibration or
eval first. So the assignment never depends on load order, and the calibration set does not move
when only the eval fraction changes.

The manifest (JSON, `data_manifest.json` in the run directory) lists every document's name, the
sha256 of its text, its size and (once tokenized) its token count. Re-opening a run directory checks
the documents against it: a changed, missing or new document is an error, because statistics,
checkpoints and evaluation numbers of the run were computed on the recorded texts.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .documents import DataError, Document, atomic_write_bytes

SPLITS = ("calibration", "train", "eval")
MANIFEST_NAME = "data_manifest.json"
_FORMAT = "megatron_tc.data_manifest"


@dataclass
class SplitConfig:
    """How documents are split. Fractions are of the whole corpus (at least one document for a
    split with a positive fraction); explicit names take precedence over fractions."""

    seed: int = 1234
    calibration_fraction: float = 0.05
    eval_fraction: float = 0.1
    calibration_docs: list[str] = field(default_factory=list)
    eval_docs: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SplitConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise DataError(f"unknown split keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def validate(self) -> None:
        for k in ("calibration_fraction", "eval_fraction"):
            v = getattr(self, k)
            if not 0.0 <= v < 1.0:
                raise DataError(f"{k} must be in [0, 1), got {v}")
        if self.calibration_fraction + self.eval_fraction >= 1.0:
            raise DataError("calibration_fraction + eval_fraction must leave documents for training")
        both = set(self.calibration_docs) & set(self.eval_docs)
        if both:
            raise DataError(f"documents named both for calibration and eval: {sorted(both)[:5]}")


def split_key(seed: int, name: str) -> str:
    return hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()


def assign_splits(names: list[str], cfg: SplitConfig) -> dict[str, list[str]]:
    """Deterministic split of document names: {split: sorted names}; the three sets are disjoint."""
    cfg.validate()
    known = set(names)
    if len(known) != len(names):
        raise DataError("document names are not unique")
    for split, pinned in (("calibration", cfg.calibration_docs), ("eval", cfg.eval_docs)):
        missing = sorted(set(pinned) - known)
        if missing:
            raise DataError(f"{split}_docs names documents that are not in the source: {missing[:5]}")
    rest = sorted(known - set(cfg.calibration_docs) - set(cfg.eval_docs), key=lambda n: split_key(cfg.seed, n))
    out: dict[str, list[str]] = {}
    for split, pinned, frac in (("calibration", cfg.calibration_docs, cfg.calibration_fraction),
                                ("eval", cfg.eval_docs, cfg.eval_fraction)):
        if pinned:
            out[split] = list(pinned)
        else:
            k = max(1, round(frac * len(names))) if frac > 0 else 0
            out[split], rest = rest[:k], rest[k:]
    out["train"] = rest
    if not out["train"]:
        raise DataError(
            f"no document is left for training ({len(names)} documents; calibration "
            f"{len(out['calibration'])}, eval {len(out['eval'])}). Add documents, lower the fractions, "
            "or split files into more documents (source.split_by=paragraph)"
        )
    return {s: sorted(out[s]) for s in SPLITS}


@dataclass
class Manifest:
    """The record of a split. `entries[split]` = [{"name", "sha256", "chars", "tokens"?}]."""

    split_config: dict[str, Any]
    entries: dict[str, list[dict[str, Any]]]
    source: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None

    @classmethod
    def create(cls, docs: list[Document], cfg: SplitConfig, source: dict[str, Any] | None = None) -> "Manifest":
        by_name = {d.name: d for d in docs}
        splits = assign_splits([d.name for d in docs], cfg)
        entries = {s: [{"name": n, "sha256": by_name[n].sha256, "chars": len(by_name[n].text)} for n in names]
                   for s, names in splits.items()}
        m = cls(split_config=asdict(cfg), entries=entries, source=source or {})
        m.check_disjoint()
        return m

    def names(self, split: str) -> list[str]:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; one of {SPLITS}")
        return [e["name"] for e in self.entries[split]]

    def check_disjoint(self) -> None:
        seen: dict[str, str] = {}
        for s in SPLITS:
            for n in self.names(s):
                if n in seen:
                    raise DataError(f"document {n!r} is in both the {seen[n]} and the {s} split")
                seen[n] = s
        digests: dict[str, str] = {}
        for s in SPLITS:
            for e in self.entries[s]:
                other = digests.get(e["sha256"])
                if other is not None and other != s:
                    raise DataError(f"document {e['name']!r} ({s}) has the same text as a {other} document")
                digests[e["sha256"]] = s

    def digest(self) -> str:
        """sha256 of the split assignment and texts (keys the tokenized-data cache)."""
        payload = {s: [(e["name"], e["sha256"]) for e in self.entries[s]] for s in SPLITS}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def verify(self, docs: list[Document], where: str = "the manifest") -> None:
        """The documents must be exactly the recorded ones, with the recorded texts."""
        recorded = {e["name"]: e["sha256"] for s in SPLITS for e in self.entries[s]}
        current = {d.name: d.sha256 for d in docs}
        changed = sorted(n for n in recorded.keys() & current.keys() if recorded[n] != current[n])
        missing = sorted(recorded.keys() - current.keys())
        new = sorted(current.keys() - recorded.keys())
        if changed or missing or new:
            parts = [f"{label} {len(v)} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
                     for label, v in (("changed", changed), ("missing", missing), ("new", new)) if v]
            raise DataError(
                f"the documents do not match {where}: {'; '.join(parts)}. The run's statistics, "
                "checkpoints and evaluations were made on the recorded texts: restore the data or "
                "start a new run directory."
            )

    def documents(self, split: str, docs: list[Document]) -> list[Document]:
        by_name = {d.name: d for d in docs}
        return [by_name[n] for n in self.names(split)]

    def set_token_counts(self, split: str, counts: list[int], tokenizer: str) -> None:
        if len(counts) != len(self.entries[split]):
            raise DataError(f"{len(counts)} token counts for {len(self.entries[split])} {split} documents")
        if self.tokenizer not in (None, tokenizer):
            for s in SPLITS:  # counts of another tokenizer are stale
                for e in self.entries[s]:
                    e.pop("tokens", None)
        self.tokenizer = tokenizer
        for e, c in zip(self.entries[split], counts):
            e["tokens"] = int(c)

    def to_json(self) -> dict[str, Any]:
        summary = {s: {"documents": len(self.entries[s]),
                       "tokens": sum(e.get("tokens", 0) for e in self.entries[s]) or None} for s in SPLITS}
        return {"format": _FORMAT, "version": 1, "split_config": self.split_config, "source": self.source,
                "tokenizer": self.tokenizer, "summary": summary, "splits": self.entries}

    def save(self, path: Path | str) -> None:
        atomic_write_bytes(Path(path), (json.dumps(self.to_json(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: Path | str) -> "Manifest":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read the data manifest ({e})") from e
        if d.get("format") != _FORMAT or set(d.get("splits", {})) != set(SPLITS):
            raise DataError(f"{path}: not a megatron_tc data manifest")
        m = cls(split_config=d["split_config"], entries=d["splits"], source=d.get("source", {}),
                tokenizer=d.get("tokenizer"))
        m.check_disjoint()
        return m


def load_or_create_manifest(run_dir: Path | str, docs: list[Document], cfg: SplitConfig,
                            source: dict[str, Any] | None = None) -> Manifest:
    """The run directory's manifest: created (atomically) on first use, verified afterwards."""
    path = Path(run_dir) / MANIFEST_NAME
    if not path.exists():
        m = Manifest.create(docs, cfg, source)
        m.save(path)
        return m
    m = Manifest.load(path)
    if m.split_config != asdict(cfg):
        raise DataError(
            f"{path} was made with other split settings ({m.split_config}) than the config's "
            f"({asdict(cfg)}); restore them or start a new run directory"
        )
    m.verify(docs, where=str(path))
    return m
