"""A run's data read from a token store (`data.token_store`) instead of text sources.

The store's documents are split exactly as text sources with the same document names would be
(`manifest.assign_splits`: hashed names, pinned names, fractions, each split in name order;
duplicates dropped by text hash under `data.dedupe`), so packing, sequences, the seeded order and
resuming are those of the text path. Nothing of the corpus is held in memory but, per split, two
int64 arrays (each document's position in the store and its offset in the split); the tokens are
read from the memory-mapped `.bin` as windows are drawn. The names are read once, at start.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .documents import DataError, Document
from .manifest import MANIFEST_NAME, SPLITS, SplitConfig
from .packing import TokenStream
from .token_store import StoreMeta, open_token_store

_FORMAT = "megatron_tc.data_manifest"


class SplitTokens:
    """The tokens of some documents of a store, in the split's order, as a read-only 1-D array:
    `len()`, integer, slice and integer-array indexing (what packing uses); int32 results."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> None:
        self._tokens, self._starts, self._offsets = tokens, starts, offsets  # [N], [D], [D+1]
        self.dtype, self.ndim = tokens.dtype, 1

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _store_positions(self, idx: np.ndarray) -> np.ndarray:
        doc = np.searchsorted(self._offsets, idx, side="right") - 1
        return self._starts[doc] + (idx - self._offsets[doc])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("SplitTokens supports slices with step 1 only")
            if stop <= start:
                return np.zeros(0, self.dtype)
            first, last = np.searchsorted(self._offsets, [start, stop - 1], side="right") - 1
            pieces = []
            for d in range(int(first), int(last) + 1):
                lo, hi = max(start, self._offsets[d]), min(stop, self._offsets[d + 1])
                at = self._starts[d] - self._offsets[d]
                pieces.append(self._tokens[at + lo:at + hi])
            return np.concatenate(pieces)
        idx = np.asarray(key)
        if np.any((idx < 0) | (idx >= len(self))):
            raise IndexError(f"token index out of range [0, {len(self)})")
        out = self._tokens[self._store_positions(idx)]
        return out if idx.ndim else out.item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[0:len(self)]
        return out if dtype is None else out.astype(dtype)


def read_store_documents(prefix: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(text hashes uint64 [D], names bytes [D]) from `PREFIX.docs.tsv`."""
    path = Path(f"{prefix}.docs.tsv")
    try:
        lines = path.read_bytes().split(b"\n")[:-1]
    except OSError as e:
        raise DataError(f"token store {prefix}: cannot read {path} ({e}); write the store with tools/preprocess.py") from None
    pairs = [line.split(b"\t", 1) for line in lines]
    if any(len(p) != 2 for p in pairs):
        raise DataError(f"{path}: a line is not '<hash>\\t<name>'; write the store again with tools/preprocess.py")
    hashes = np.array([int(h, 16) for h, _ in pairs], dtype=np.uint64)
    return hashes, np.array([n for _, n in pairs], dtype=bytes)


def store_split_indices(hashes: np.ndarray, names: np.ndarray, cfg: SplitConfig,
                        dedupe: bool) -> dict[str, np.ndarray]:
    """{split: store document indices int64, in name order}, as `manifest.assign_splits` splits
    the same names (its sha256 key order compared on 64 bits)."""
    cfg.validate()
    keep = np.sort(np.unique(hashes, return_index=True)[1]) if dedupe else np.arange(len(names))
    kept_names = names[keep]
    if len(np.unique(kept_names)) != len(kept_names):
        raise DataError("two documents of the token store have one name; names must be unique because the "
                        "split assigns documents by name")
    pinned: dict[str, np.ndarray] = {}
    for split, wanted in (("calibration", cfg.calibration_docs), ("eval", cfg.eval_docs)):
        wanted_b = np.array([w.encode("utf-8") for w in wanted], dtype=bytes) if wanted else np.zeros(0, bytes)
        found = keep[np.isin(kept_names, wanted_b)]
        if len(found) != len(set(wanted)):
            missing = sorted(set(wanted) - {n.decode("utf-8") for n in names[found]})
            raise DataError(f"{split}_docs names documents that are not in the token store: {missing[:5]}")
        pinned[split] = found
    rest = np.setdiff1d(keep, np.concatenate(list(pinned.values())))
    keys = np.array([int.from_bytes(hashlib.sha256(f"{cfg.seed}:".encode() + n).digest()[:8], "big")
                     for n in names[rest]], dtype=np.uint64)
    rest = rest[np.argsort(keys, kind="stable")]
    out: dict[str, np.ndarray] = {}
    for split, frac in (("calibration", cfg.calibration_fraction), ("eval", cfg.eval_fraction)):
        if len(pinned[split]):
            out[split] = pinned[split]
        else:
            k = max(1, round(frac * len(keep))) if frac > 0 else 0
            out[split], rest = rest[:k], rest[k:]
    out["train"] = rest
    if not len(rest):
        raise DataError(f"no document of the token store is left for training ({len(keep)} documents); lower "
                        "data.split's fractions or preprocess more documents")
    if not dedupe:
        _check_texts_disjoint(hashes, out)
    return {s: np.asarray(out[s][np.argsort(names[out[s]], kind="stable")], dtype=np.int64) for s in SPLITS}


def _check_texts_disjoint(hashes: np.ndarray, splits: dict[str, np.ndarray]) -> None:
    idx = np.concatenate([splits[s] for s in SPLITS])
    label = np.concatenate([np.full(len(splits[s]), i) for i, s in enumerate(SPLITS)])
    order = np.lexsort((label, hashes[idx]))
    h, lab = hashes[idx][order], label[order]
    clash = (h[1:] == h[:-1]) & (lab[1:] != lab[:-1])
    if clash.any():
        i = int(np.argmax(clash))
        raise DataError(f"the token store holds one text in the {SPLITS[lab[i]]} and the {SPLITS[lab[i + 1]]} "
                        "split; set data.dedupe=true")


def split_stream(store: TokenStream, indices: np.ndarray) -> TokenStream:
    """The documents `indices` of the store, in that order, as a TokenStream over the memory map."""
    lengths = np.diff(store.offsets)[indices]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenStream(tokens=SplitTokens(store.tokens, store.offsets[indices], offsets), offsets=offsets)


def check_store_matches(prefix: str | Path, meta: StoreMeta, fingerprint: str, eos_id: int, bos_id: int | None,
                        add_special_tokens: bool) -> None:
    """The store must have been tokenized as the run tokenizes: one error naming the difference."""
    redo = f"preprocess the corpus again (tools/preprocess.py --tokenizer <the teacher's tokenizer> --out {prefix})"
    if meta.tokenizer_fingerprint != fingerprint:
        raise DataError(f"token store {prefix} was tokenized with another tokenizer (fingerprint "
                        f"{meta.tokenizer_fingerprint[:12]}) than the run's (fingerprint {fingerprint[:12]}); {redo}")
    if meta.eos_id != eos_id:
        raise DataError(f"token store {prefix} ends documents with token {meta.eos_id}, the run with {eos_id} "
                        f"(data.eos_token); set data.eos_token to match or {redo} and --eos-token")
    if meta.bos_id != bos_id:
        raise DataError(f"token store {prefix} was written with BOS {meta.bos_id}, the run's data.bos gives {bos_id}; "
                        f"set data.bos to match or {redo} and --bos")
    if meta.add_special_tokens != add_special_tokens:
        raise DataError(f"token store {prefix} was written with add_special_tokens={meta.add_special_tokens}, the "
                        f"run has data.add_special_tokens={add_special_tokens}; set it to match or {redo}")


def check_or_write_manifest(run_dir: Path, prefix: str | Path, meta: StoreMeta, cfg: SplitConfig, dedupe: bool,
                            names: np.ndarray, splits: dict[str, np.ndarray], lengths: np.ndarray) -> None:
    """The run directory's record of the split: written on first use (calibration and eval documents
    by name, training by count), afterwards checked to be of the same store and split settings."""
    path = run_dir / MANIFEST_NAME
    source = {"token_store": str(prefix), "store": meta.digest(), "dedupe": dedupe}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: cannot read the data manifest ({e})") from None
        if "token_store" not in old.get("source", {}):
            raise DataError(f"{path} records a run prepared from text sources, not a token store; start a new run "
                            "directory")
        for what, mine, theirs in (("token store", source["store"], old["source"].get("store")),
                                   ("split settings", asdict(cfg), old.get("split_config")),
                                   ("dedupe setting", dedupe, old["source"].get("dedupe"))):
            if mine != theirs:
                raise DataError(f"{path} was made with another {what} than the config's; restore it or start a new "
                                "run directory")
        return
    from .documents import atomic_write_bytes

    def entries(split: str) -> list[dict[str, Any]]:
        return [{"name": names[i].decode("utf-8"), "tokens": int(lengths[i])} for i in splits[split]]

    record = {"format": _FORMAT, "version": 1, "split_config": asdict(cfg), "source": source,
              "tokenizer": meta.tokenizer_fingerprint,
              "summary": {s: {"documents": len(splits[s]), "tokens": int(lengths[splits[s]].sum())} for s in SPLITS},
              "splits": {"calibration": entries("calibration"), "eval": entries("eval"),
                         "train": "every other document of the token store"}}
    atomic_write_bytes(path, (json.dumps(record, indent=1) + "\n").encode())


class StoreManifest:
    """`names(split)` of a store-backed run (what stages record), read from the store on demand."""

    def __init__(self, prefix: str | Path, splits: dict[str, np.ndarray]) -> None:
        self.prefix, self.splits = prefix, splits

    def names(self, split: str) -> list[str]:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; one of {SPLITS}")
        _, names = read_store_documents(self.prefix)
        return [n.decode("utf-8") for n in names[self.splits[split]]]


def open_store_splits(prefix: str | Path, cfg: SplitConfig, dedupe: bool, run_dir: Path | None = None,
                      meta: StoreMeta | None = None) -> tuple[dict[str, TokenStream], StoreManifest]:
    """({split: TokenStream}, manifest) of a store; records or checks the split in `run_dir`."""
    meta = meta or StoreMeta.load(prefix)
    store = open_token_store(prefix)
    hashes, names = read_store_documents(prefix)
    if len(names) != store.num_docs:
        raise DataError(f"token store {prefix}: {prefix}.docs.tsv lists {len(names)} documents, the index "
                        f"{store.num_docs}; write the store again")
    splits = store_split_indices(hashes, names, cfg, dedupe)
    if run_dir is not None:
        check_or_write_manifest(Path(run_dir), prefix, meta, cfg, dedupe, names, splits, store.doc_lengths())
    return {s: split_stream(store, splits[s]) for s in SPLITS}, StoreManifest(prefix, splits)


def decode_documents(stream: TokenStream, names: list[str], tokenizer: Any) -> list[Document]:
    """The split's documents as text again (decoded tokens, special tokens dropped)."""
    return [Document(name, tokenizer.decode(np.asarray(stream.tokens[stream.offsets[d]:stream.offsets[d + 1]]).tolist(),
                                            skip_special_tokens=True))
            for d, name in enumerate(names)]
