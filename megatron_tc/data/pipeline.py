"""One call from a data config to split, tokenized, packed data in a run directory.

    data = prepare_data(DataConfig.from_dict(cfg["data"]), run_dir, tokenizer=teacher_tok,
                        model_vocab_size=arch.vocab_size)
    calib = data.sequences("calibration", seq_len=256)          # PackedSequences
    loader = data.loader("train", global_batch_size=64, micro_batch_size=4,
                         dp_rank=r, dp_size=d, seed=1234)          # DistributedBatchLoader
    texts = data.documents("eval")                                 # list[Document]

Safe to call from every rank at once (all writes are atomic and their contents deterministic);
calling it on rank 0 first and then on the others after a barrier avoids tokenizing twice.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from .bos import bos_record, parse_bos_setting, resolve_bos_id
from .documents import DataError, Document
from .loader import DistributedBatchLoader
from .manifest import SPLITS, Manifest, SplitConfig, load_or_create_manifest
from .packing import PackedSequences, TokenStream
from .sources import SourceConfig, load_documents
from .tokenize import cached_token_stream
from .tokenizer import check_token_ids_fit, check_vocab_fits, load_tokenizer, resolve_eos_id, tokenizer_fingerprint


@dataclass
class DataConfig:
    """source: where documents come from; split: calibration/train/eval assignment;
    tokenizer: path (HF dir, .gguf, sentencepiece .model), or None when the caller passes the
    teacher's tokenizer; seq_len: default sequence length; eos_token: separator appended after each
    document (default: the tokenizer's EOS); add_special_tokens: let the tokenizer add its own
    (e.g. BOS) to each document; bos: "auto" | True | False, whether every sequence starts with BOS
    (megatron_tc.data.bos; "auto" follows the tokenizer); dedupe: drop exact-duplicate texts (keeps
    the first by load order), so no text can land in two splits; token_store: the prefix of a store
    written by tools/preprocess.py, read instead of `source` (megatron_tc.data.store_data)."""

    source: SourceConfig = field(default_factory=SourceConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    tokenizer: str | None = None
    seq_len: int = 2048
    eos_token: str | None = None
    add_special_tokens: bool = True
    bos: str | bool = "auto"
    dedupe: bool = True
    token_store: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], strict: bool = True) -> "DataConfig":
        """From a dict (YAML's `data:` section). strict=False ignores top-level keys that are not
        the pipeline's (the run config's data section also holds batch sizes and token budgets)."""
        d = dict(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if not strict:
            d = {k: v for k, v in d.items() if k not in unknown}
        elif unknown:
            raise DataError(f"unknown data config keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        source = SourceConfig.from_dict(d.pop("source", {}) or {})
        split = SplitConfig.from_dict(d.pop("split", {}) or {})
        if "bos" in d:
            d["bos"] = parse_bos_setting(d["bos"])
        return cls(source=source, split=split, **d)

    @classmethod
    def from_config(cls, section: Any) -> "DataConfig":
        """From the run config's data section (a dataclass such as `megatron_tc.config`'s, or a dict)."""
        if is_dataclass(section) and not isinstance(section, type):
            section = asdict(section)
        return cls.from_dict(section, strict=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dedupe_documents(docs: list[Document]) -> tuple[list[Document], list[str]]:
    """Drop documents whose text equals an earlier one's; returns (kept, dropped names)."""
    seen: set[str] = set()
    kept, dropped = [], []
    for d in docs:
        if d.sha256 in seen:
            dropped.append(d.name)
        else:
            seen.add(d.sha256)
            kept.append(d)
    return kept, dropped


class PreparedData:
    """The run's documents, manifest and (lazily tokenized, cached) token streams. `bos_id`: the BOS
    every sequence starts with (cfg.bos resolved against the tokenizer), or None."""

    def __init__(self, cfg: DataConfig, run_dir: Path | None, docs: list[Document], manifest: Manifest,
                 tokenizer: Any, model_vocab_size: int | None) -> None:
        self.cfg, self.run_dir, self.manifest, self.tokenizer = cfg, run_dir, manifest, tokenizer
        self.model_vocab_size = model_vocab_size
        self.eos_id = resolve_eos_id(tokenizer, cfg.eos_token)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.bos_id = resolve_bos_id(tokenizer, cfg.bos)
        self._docs = {s: manifest.documents(s, docs) for s in SPLITS}
        self._streams: dict[str, tuple[TokenStream, str]] = {}

    def bos_record(self) -> dict[str, Any]:
        """The BOS convention, as results files record it (megatron_tc.data.bos.bos_record)."""
        return bos_record(self.bos_id, self.cfg.bos)

    def documents(self, split: str) -> list[Document]:
        return list(self._docs[split])

    def token_stream(self, split: str) -> tuple[TokenStream, str]:
        """(stream, cache key) of a split; tokenizes on first use and records token counts."""
        if split not in self._streams:
            stream, key = cached_token_stream(self.run_dir, split, self._docs[split], self.tokenizer,
                                              self.eos_id, self.cfg.add_special_tokens, self.bos_id)
            if self.model_vocab_size is not None and len(stream.tokens):
                check_token_ids_fit(int(stream.tokens.max()), self.model_vocab_size, f"the {split} data")
            self._streams[split] = (stream, key)
            self._record_token_counts(split, stream)
        return self._streams[split]

    def _record_token_counts(self, split: str, stream: TokenStream) -> None:
        counts = [int(c) for c in stream.doc_lengths()]
        if [e.get("tokens") for e in self.manifest.entries[split]] == counts:
            return
        self.manifest.set_token_counts(split, counts, tokenizer_fingerprint(self.tokenizer))
        if self.run_dir is not None:
            self.manifest.save(self.run_dir / "data_manifest.json")

    def sequences(self, split: str, seq_len: int | None = None, drop_last: bool | None = None) -> PackedSequences:
        """Packed sequences of a split (drop_last defaults to True for train, False otherwise)."""
        stream, key = self.token_stream(split)
        drop = (split == "train") if drop_last is None else drop_last
        return PackedSequences(stream, seq_len or self.cfg.seq_len, self.pad_id, drop_last=drop, fingerprint=key,
                               bos_id=self.bos_id)

    def first_sequences(self, split: str, num_tokens: int, seq_len: int | None = None) -> dict[str, Any]:
        """The first ceil(num_tokens / T) packed sequences of a split, in manifest order: a dict of
        int64 tensors [B, T] (input_ids, labels, doc_ids, position_ids). For calibration/eval
        passes that want a fixed token budget; the last sequence may be padded."""
        seqs = self.sequences(split, seq_len, drop_last=False)
        want = -(-num_tokens // seqs.seq_len)
        if want > len(seqs):
            raise DataError(f"the {split} split holds {len(seqs.stream.tokens)} tokens, fewer than the "
                            f"{num_tokens} asked for; lower the token budget or add documents")
        return seqs.batch(range(want))

    def sampled_sequences(self, split: str, num_tokens: int, seq_len: int | None = None, skip_tokens: int = 0,
                          order: str = "random") -> dict[str, Any]:
        """ceil(num_tokens / T) packed sequences of a split, as first_sequences, after the first
        ceil(skip_tokens / T) of the same order (so two calls with consecutive budgets never share a
        sequence). order "random": full sequences in a permutation seeded by data.split.seed (a
        sample across all documents of the split); "stream": manifest order (the split's first
        documents only)."""
        import numpy as np

        if order not in ("random", "stream"):
            raise DataError(f"sequence order {order!r} is unknown; use 'random' or 'stream'")
        if order == "stream":
            rows = self.first_sequences(split, num_tokens + skip_tokens, seq_len)
            first = -(-skip_tokens // (seq_len or self.cfg.seq_len))
            return {k: v[first:] for k, v in rows.items()}
        seqs = self.sequences(split, seq_len, drop_last=True)
        skip, want = -(-skip_tokens // seqs.seq_len), -(-num_tokens // seqs.seq_len)
        if skip + want > len(seqs):
            raise DataError(f"the {split} split holds {len(seqs)} full sequences of {seqs.seq_len} tokens, fewer "
                            f"than the {skip + want} asked for ({num_tokens} tokens after {skip_tokens}); lower the "
                            "token budget or add documents")
        picked = np.random.default_rng(self.cfg.split.seed).permutation(len(seqs))[skip:skip + want]
        return seqs.batch([int(i) for i in picked])

    def token_ids(self, split: str, max_tokens: int | None = None) -> Any:
        """The split's token stream (documents each followed by EOS) as a LongTensor [N]."""
        import torch

        stream, _ = self.token_stream(split)
        n = len(stream.tokens) if max_tokens is None else min(max_tokens, len(stream.tokens))
        return torch.from_numpy(stream.tokens[:n].astype("int64"))

    def write_text(self, split: str, path: Path | str) -> Path:
        """Write the split's documents, in manifest order and separated by a blank line, as one
        UTF-8 file (for tools that take `--text FILE`); atomic."""
        from .documents import atomic_write_bytes

        text = "\n\n".join(d.text.strip("\n") for d in self.documents(split)) + "\n"
        atomic_write_bytes(Path(path), text.encode("utf-8"))
        return Path(path)

    def loader(self, split: str = "train", *, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
               dp_size: int = 1, seed: int = 0, shuffle: bool = True, seq_len: int | None = None) -> DistributedBatchLoader:
        return DistributedBatchLoader(self.sequences(split, seq_len, drop_last=True), global_batch_size,
                                      micro_batch_size, dp_rank, dp_size, seed, shuffle)


class StoreData(PreparedData):
    """PreparedData over a token store (`cfg.token_store`): the same splits, sequences and loaders,
    the tokens read from the memory-mapped store instead of tokenized text."""

    def __init__(self, cfg: DataConfig, run_dir: Path | None, tokenizer: Any, model_vocab_size: int | None) -> None:
        from .store_data import check_store_matches, open_store_splits
        from .token_store import StoreMeta

        self.cfg, self.run_dir, self.tokenizer, self.model_vocab_size = cfg, run_dir, tokenizer, model_vocab_size
        self.eos_id = resolve_eos_id(tokenizer, cfg.eos_token)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.bos_id = resolve_bos_id(tokenizer, cfg.bos)
        meta = StoreMeta.load(cfg.token_store)
        check_store_matches(cfg.token_store, meta, tokenizer_fingerprint(tokenizer), self.eos_id, self.bos_id,
                            cfg.add_special_tokens)
        if model_vocab_size is not None:
            check_token_ids_fit(meta.max_token_id, model_vocab_size, f"the token store {cfg.token_store}")
        streams, self.manifest = open_store_splits(cfg.token_store, cfg.split, cfg.dedupe, run_dir, meta)
        key = f"{meta.digest()}:{self._split_key()}"
        self._streams = {s: (stream, f"{key}:{s}") for s, stream in streams.items()}

    def _split_key(self) -> str:
        """Keys the loader's resume check: the same store split the same way."""
        import hashlib
        import json

        payload = {"split": asdict(self.cfg.split), "dedupe": self.cfg.dedupe}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def documents(self, split: str) -> list[Document]:
        """The split's documents decoded from their tokens (the store holds no text)."""
        from .store_data import decode_documents

        return decode_documents(self._streams[split][0], self.manifest.names(split), self.tokenizer)

    def token_stream(self, split: str) -> tuple[TokenStream, str]:
        return self._streams[split]



def prepare_data(cfg: DataConfig, run_dir: Path | str | None, tokenizer: Any = None,
                 model_vocab_size: int | None = None) -> PreparedData:
    """Load documents, split them (manifest in `run_dir`, verified if it exists), check the
    tokenizer against the model's vocabulary. Tokenization happens lazily per split. With
    `cfg.token_store` the documents and their tokens come from the store instead."""
    if tokenizer is None:
        if cfg.tokenizer is None:
            raise DataError("no tokenizer: set data.tokenizer or pass the teacher's tokenizer")
        tokenizer = load_tokenizer(cfg.tokenizer)
    if model_vocab_size is not None:
        check_vocab_fits(tokenizer, model_vocab_size)
    if cfg.token_store is not None:
        if asdict(cfg.source) != asdict(SourceConfig()):
            raise DataError("data.token_store and data.source are exclusive: the store holds the documents; remove "
                            "the data.source settings (or data.token_store)")
        return StoreData(cfg, None if run_dir is None else Path(run_dir), tokenizer, model_vocab_size)
    docs = load_documents(cfg.source)
    if cfg.dedupe:
        docs, _ = dedupe_documents(docs)
    source = asdict(cfg.source)
    if run_dir is None:
        manifest = Manifest.create(docs, cfg.split, source)
        return PreparedData(cfg, None, docs, manifest, tokenizer, model_vocab_size)
    run_dir = Path(run_dir)
    manifest = load_or_create_manifest(run_dir, docs, cfg.split, source)
    return PreparedData(cfg, run_dir, docs, manifest, tokenizer, model_vocab_size)
