"""Where the standalone tools (stats, calibrate, select_layers) read calibration rows from: a text
file (`--text`) or the calibration split of a token store (`--token-store`).

A store is read through the run's own data path (`data.prepare_data` with `data.token_store`):
the same split of its documents (`--split KEY=VALUE` as data.split), the same packed sequences in
the same order (`--calib-order` as data.calib_order), so a tool sees the rows a run over the same
store calibrates on. The store must have been tokenized by the teacher's tokenizer with the BOS
convention of `--bos` (the run's check, `store_data.check_store_matches`); its EOS and special-token
settings are the store's own.

For the overlap check against `--eval-text`, the calibration documents are decoded (the store holds
no text) and paragraph-hashed as a text file is. Decoding may not give the text back byte for byte
(e.g. `clean_up_tokenization_spaces`), so each evaluation paragraph is also compared as the
tokenizer gives it back (encoded, then decoded). A tokenizer that drops blank lines cannot give the
paragraphs back at all: a store of such a tokenizer is refused where the check needs its text.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from functools import cached_property
from typing import Any

import torch

from megatron_tc.config.errors import InputError
from megatron_tc.data.overlap import documents_record, paragraph_hashes, paragraphs, text_record


def add_source_args(ap: argparse.ArgumentParser) -> None:
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", default=None, help="calibration text file (never the evaluation text)")
    source.add_argument("--token-store", default=None, metavar="PREFIX",
                        help="token store of tools/preprocess.py: calibrate on its calibration split, packed and "
                             "ordered as a run with data.token_store=PREFIX")
    ap.add_argument("--split", action="append", default=[], metavar="KEY=VALUE",
                    help="--token-store: a data.split setting of the run (seed, calibration_fraction, eval_fraction, "
                         "calibration_docs, eval_docs; repeatable; YAML values, e.g. calibration_docs=[a,b])")
    ap.add_argument("--calib-order", default=None, choices=("random", "stream"),
                    help="--token-store: which calibration sequences, as data.calib_order (default random: a "
                         "sample over the split seeded by its seed; stream: its first documents)")


def _split_config(items: list[str]) -> Any:
    import yaml

    from megatron_tc.data.manifest import SplitConfig

    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise InputError(f"error: --split {item!r}: expected KEY=VALUE (e.g. seed=7)")
        values[key.strip()] = yaml.safe_load(value)
    try:
        cfg = SplitConfig.from_dict(values)
        cfg.validate()
    except Exception as err:  # DataError or a wrongly typed value
        raise InputError(f"error: --split: {err}") from None
    return cfg


class TextSource:
    """Calibration rows from a text file: contiguous windows of its tokens (teacher_io.text_batches)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @cached_property
    def record(self) -> dict:
        """The text's paragraph hashes (overlap.text_record)."""
        return text_record(self.path)

    def describe(self) -> dict:
        return {"text": os.path.abspath(self.path)}

    def comparable(self, evaluation: dict) -> dict:
        """The evaluation text's record as this source's record can be compared with it."""
        return evaluation

    def document_names(self) -> list[str]:
        from pathlib import Path

        return [Path(self.path).stem]

    def batches(self, tokenizer: Any, tokens: int, seq_len: int, bos_id: int | None,
                skip_tokens: int = 0) -> list[dict[str, torch.Tensor]]:
        from .teacher_io import text_batches

        return text_batches(self.path, tokenizer, tokens, seq_len, skip_tokens=skip_tokens, bos_id=bos_id)


class StoreSource:
    """Calibration rows from a token store's calibration split, as a run reads them."""

    def __init__(self, prefix: str, tokenizer: Any, bos: str, split: Any, order: str) -> None:
        from megatron_tc.data import DataConfig, prepare_data
        from megatron_tc.data.bos import parse_bos_setting
        from megatron_tc.data.token_store import StoreMeta

        self.prefix, self.order = prefix, order
        meta = StoreMeta.load(prefix)
        eos = tokenizer.convert_ids_to_tokens(meta.eos_id) if 0 <= meta.eos_id < len(tokenizer) else None
        cfg = DataConfig(token_store=prefix, split=split, bos=parse_bos_setting(bos), eos_token=eos,
                         add_special_tokens=meta.add_special_tokens)
        self.data = prepare_data(cfg, None, tokenizer=tokenizer)
        self.digest = meta.digest()

    def _round_trip(self, text: str) -> str:
        tok = self.data.tokenizer
        return tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)

    @cached_property
    def record(self) -> dict:
        """The calibration documents' paragraph hashes, decoded from their tokens."""
        if len(paragraphs(self._round_trip("The first paragraph.\n\nThe second paragraph."))) != 2:
            raise InputError(f"error: --token-store {self.prefix}: the teacher's tokenizer does not give blank lines "
                             "back when decoding, so the store's calibration text cannot be split into paragraphs "
                             "for the overlap check against evaluation text; give the calibration text as --text")
        docs = self.data.documents("calibration")
        return documents_record(f"token store {self.prefix} (calibration split, {len(docs)} documents)",
                                (d.text for d in docs))

    def describe(self) -> dict:
        return {"token_store": os.path.abspath(self.prefix), "store": self.digest,
                "split": asdict(self.data.cfg.split), "calib_order": self.order}

    def comparable(self, evaluation: dict) -> dict:
        """`evaluation` (a text_record) with the hashes of its paragraphs as the tokenizer decodes them."""
        with open(evaluation["path"], encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        decoded = set().union(*(paragraph_hashes(self._round_trip(p)) for p in paragraphs(text)))
        return {**evaluation, "paragraph_hashes": sorted(set(evaluation["paragraph_hashes"]) | decoded)}

    def document_names(self) -> list[str]:
        return self.data.manifest.names("calibration")

    def batches(self, tokenizer: Any, tokens: int, seq_len: int, bos_id: int | None,
                skip_tokens: int = 0) -> list[dict[str, torch.Tensor]]:
        """One row per batch, input_ids and doc_ids [1, T], as a run's calibration batches."""
        if bos_id != self.data.bos_id:  # both come from --bos and the teacher's tokenizer
            raise ValueError(f"BOS {bos_id} differs from the store's packing BOS {self.data.bos_id}")
        try:
            rows = self.data.sampled_sequences("calibration", tokens, seq_len, skip_tokens, order=self.order)
        except ValueError as err:
            raise ValueError(f"token store {self.prefix}: {err}") from None
        return [{k: rows[k][i:i + 1] for k in ("input_ids", "doc_ids")} for i in range(rows["input_ids"].shape[0])]


def open_source(args: argparse.Namespace) -> TextSource | StoreSource:
    """The source the arguments name; a store is opened with the teacher's tokenizer and checked
    against it (one error line on a mismatch) before the teacher's weights are read."""
    if args.text is not None:
        if args.split or args.calib_order is not None:
            raise InputError("error: --split and --calib-order apply to --token-store only; remove them with --text")
        return TextSource(args.text)
    from megatron_tc.data.documents import DataError
    from megatron_tc.eval.loading import load_tokenizer

    split = _split_config(args.split)
    try:
        tokenizer = load_tokenizer(args.teacher)
    except ValueError as err:
        raise InputError(f"error: --teacher {args.teacher}: {err}") from None
    try:
        return StoreSource(args.token_store, tokenizer, args.bos, split, args.calib_order or "random")
    except DataError as err:
        raise InputError(f"error: --token-store {args.token_store}: {err}") from None
