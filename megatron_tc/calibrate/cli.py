"""Command lines behind tools/stats.py, tools/calibrate.py and tools/select_layers.py."""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from megatron_tc.config.errors import InputError, command_line
from megatron_tc.data.overlap import OverlapError, check_disjoint, text_record

from .calib_source import add_source_args, open_source
from .policies import POLICIES, POLICY_ALIASES, log_selection, policy_name, select_layers, uniform
from .stats import collect_stats, describe, log_stats
from .statsfile import TaylorStats
from .strategies import REGISTRY, get_strategy
from .student import calibrate_student, converted_layers, pattern_from_keep
from .teacher_io import load_teacher

PAPER_STRATEGIES = ("taylor", "taylor_fit", "taylor_fit-closed", "taylor_fit-bias", "taylor_fit-sinkfree")  # readout sums: every other registered strategy reuses one of these


def _user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """`main` with the errors a user fixes (a teacher path that is not a model, a stats file of
    another teacher or version, a strategy the student cannot take, bad data, the `InputError`s
    of the argument checks) as one `error:` line and exit status 2, not a traceback; every other
    exception propagates."""
    from megatron_tc.data.documents import DataError
    from megatron_tc.eval.loading import ModelLoadError
    from megatron_tc.model.config import ArchConfigError

    from .statsfile import StatsMismatchError
    from .strategies import StrategyError

    @functools.wraps(main)
    @command_line
    def run(argv=None) -> int:
        try:
            return main(argv)
        except (ModelLoadError, StatsMismatchError, StrategyError, DataError, ArchConfigError) as err:
            raise InputError(f"error: {err}") from None

    return run


def _need_file(flag: str, path: str | None, what: str) -> None:
    """Exit with one error line when the file a flag names is not there (before any work)."""
    if path is not None and not os.path.isfile(path):
        raise InputError(f"error: {flag} {path}: no such file; give {what}")


def _check_paths(args) -> None:
    _need_file("--text", getattr(args, "text", None), "the calibration text file")
    _need_file("--eval-text", getattr(args, "eval_text", None), "the evaluation text file")
    _need_file("--stats", getattr(args, "stats", None), "a stats file written by tools/stats.py")
    if getattr(args, "policy", None) is not None:
        args.policy = policy_name(args.policy)
        if args.policy == "readout_gap" and getattr(args, "stats", None) is None:
            raise InputError("error: --policy stats (readout_gap) reads the statistics of every layer: give --stats, "
                             "a file written by tools/stats.py with its default --layers and --readout")


POLICY_CHOICES = (*POLICIES, *POLICY_ALIASES)  # `stats` as the run config names it


def _layers(text: str, num_layers: int) -> list[int]:
    if text in ("all", ""):
        return list(range(num_layers))
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InputError(f"error: layers must be comma-separated integers or 'all', got {text!r}") from None


def _data_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--teacher", required=True, help="megatron_tc checkpoint, HF directory or .gguf")
    add_source_args(ap)
    ap.add_argument("--eval-text", default=None,
                    help="the evaluation text: refused when the calibration text shares a paragraph with it "
                         "(tools/calibrate.py also reports zero-shot perplexity on it)")
    ap.add_argument("--tokens", type=int, default=2048, help="calibration tokens (whole rows of --seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--bos", default="auto", choices=("auto", "true", "false"),
                    help="start every row with BOS: auto = when the teacher's tokenizer adds BOS to encoded text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--tb", default=None, help="TensorBoard log directory")
    ap.add_argument("--no-progress", action="store_true")


def _writer(path):
    """--tb's TensorBoard writer (a no-op without one); use it in `with` so its events are flushed."""
    from megatron_tc.monitor import TBWriter

    return TBWriter(path, enabled=None) if path else TBWriter("", enabled=False)


def _bos_id(args, teacher) -> int | None:
    from megatron_tc.data.bos import resolve_bos_id
    from megatron_tc.data.documents import DataError

    try:
        return resolve_bos_id(teacher.tokenizer, args.bos)
    except DataError as err:
        raise InputError(f"error: --bos {args.bos}: {err}") from None


def _bos_record(args, bos_id: int | None) -> dict:
    from megatron_tc.data.bos import bos_record

    return bos_record(bos_id, args.bos)


def _meta(args, teacher, bos_id: int | None, source) -> dict:
    return {"teacher_sha256": teacher.sha256, "teacher_path": str(teacher.path), **source.describe(),
            "tokens_requested": args.tokens, "seq_len": args.seq_len, "documents": source.document_names(),
            "text_record": source.record, **_bos_record(args, bos_id)}


def _refuse_overlap(args, source, stats: TaylorStats | None = None) -> None:
    """Exit with one error line when the calibration text (a --text file or the store's decoded
    calibration documents; or the text a stats file was computed on) shares a paragraph with --eval-text."""
    if not args.eval_text:
        return
    records = [source.record]
    evaluation = source.comparable(text_record(args.eval_text))
    if stats is not None and "text_record" in stats.meta:
        records.append(stats.meta["text_record"])
    try:
        for record in records:
            check_disjoint(record, evaluation)
    except OverlapError as err:
        raise InputError(f"error: {err}") from None


@_user_errors
def stats_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Taylor statistics pass over calibration text -> stats file")
    _data_args(ap)
    ap.add_argument("--layers", default="all", help="layers to measure (comma list or 'all')")
    ap.add_argument("--readout", default=",".join(PAPER_STRATEGIES),
                    help="strategies whose readout sums to accumulate ('' for none)")
    ap.add_argument("--chunk-size", type=int, default=128, help="queries per attention-probability chunk")
    ap.add_argument("--out", required=True, help="stats file to write")
    args = ap.parse_args(argv)
    _check_paths(args)
    source = open_source(args)
    _ = source.record  # the stats file records the text's hashes: made (or refused) before any work
    _refuse_overlap(args, source)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher = load_teacher(args.teacher)
    layers = _layers(args.layers, teacher.model.arch.num_layers)
    bos_id = _bos_id(args, teacher)
    batches = _batches(source, teacher, args, bos_id)
    strategies = [get_strategy(s) for s in args.readout.split(",") if s]
    student_arch = teacher.model.arch.with_pattern("G" * teacher.model.arch.num_layers)
    t0 = time.time()
    stats = collect_stats(teacher.model, batches, layers, _meta(args, teacher, bos_id, source),
                          readout_strategies=strategies, student_arch=student_arch, chunk_size=args.chunk_size,
                          progress=not args.no_progress)
    stats.meta["num_layers"] = teacher.model.arch.num_layers
    stats.meta["seconds"] = round(time.time() - t0, 1)
    stats.save(args.out)
    with _writer(args.tb) as writer:
        log_stats(stats, writer)
    print(json.dumps({"out": args.out, "tokens": stats.meta["tokens"], "seconds": stats.meta["seconds"],
                      "bos": stats.meta["bos"], "layers": describe(stats)}, indent=1))
    return 0


def _keep(args, teacher, stats, batches) -> tuple[list[int], dict | None]:
    arch = teacher.model.arch
    if args.keep is not None:
        return _layers(args.keep, arch.num_layers), None
    num_keep = args.num_keep or max(1, round(arch.num_layers / 4))
    if args.policy == "uniform":
        sel = uniform(arch.num_layers, num_keep)
    else:
        sel = select_layers(args.policy, num_keep, teacher=teacher.model, stats=stats, batches=batches,
                            **({"teacher_sha256": teacher.sha256} if args.policy in ("ar", "ga") else {}))
    return sel.keep, sel.to_json()


def _batches(source, teacher, args, bos_id: int | None) -> list[dict]:
    """The first --tokens calibration tokens of the source as one-row batches."""
    try:
        return source.batches(teacher.tokenizer, args.tokens, args.seq_len, bos_id)
    except ValueError as err:
        raise InputError(f"error: --tokens {args.tokens}: {err}; give more calibration text or fewer --tokens") \
            from None


def _heldout_batches(args, teacher, strategy: str, bos_id: int | None, source) -> list[dict]:
    """The calibration tokens after --tokens (a quarter of --tokens by default, at least one row)."""
    tokens = args.heldout_tokens if args.heldout_tokens is not None else max(args.seq_len, args.tokens // 4)
    where = args.text if args.text is not None else f"the calibration split of {args.token_store}"
    try:
        return source.batches(teacher.tokenizer, tokens, args.seq_len, bos_id, skip_tokens=args.tokens)
    except ValueError as err:
        raise InputError(f"error: --init {strategy} picks its best alignment step on held-out calibration tokens "
                         f"({tokens} after the first --tokens {args.tokens} of {where}), but {err}; give more "
                         "calibration text, fewer --tokens, or --heldout-tokens of at least --seq-len") from None


def _calibrate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="teacher -> zero-shot hybrid student checkpoint (no training)")
    _data_args(ap)
    ap.add_argument("--init", required=True, choices=sorted(REGISTRY))
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--keep", help="layers kept as softmax attention (comma list)")
    group.add_argument("--policy", choices=POLICY_CHOICES,
                       help="choose the kept layers with a policy (stats: readout_gap, as model.policy names it)")
    ap.add_argument("--num-keep", type=int, default=0, help="kept layers for --policy (default: a quarter)")
    ap.add_argument("--stats", default=None, help="reuse a stats file from tools/stats.py")
    ap.add_argument("--heldout-tokens", type=int, default=None,
                    help="calibration tokens after --tokens on which a strategy that needs them (taylor_fit) picks its "
                         "best alignment step (default: a quarter of --tokens, at least one row)")
    ap.add_argument("--align-steps", type=int, default=None, help="override the strategy's alignment steps")
    ap.add_argument("--no-align", action="store_true")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    return ap


@_user_errors
def calibrate_main(argv=None) -> int:
    args = _calibrate_parser().parse_args(argv)
    _check_paths(args)
    source = open_source(args)
    _refuse_overlap(args, source)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher = load_teacher(args.teacher)
    strategy = get_strategy(args.init)
    bos_id = _bos_id(args, teacher)
    batches = _batches(source, teacher, args, bos_id)
    stats = TaylorStats.load(args.stats, teacher_sha256=teacher.sha256) if args.stats else None
    strategy.check_stats(stats)
    _refuse_overlap(args, source, stats)
    heldout = None
    if not args.no_align and strategy.align is not None and strategy.align.best_on == "heldout":
        heldout = _heldout_batches(args, teacher, strategy.name, bos_id, source)
    keep, selection = _keep(args, teacher, stats, batches)
    align = False if args.no_align else True
    if align and strategy.align is not None and args.align_steps is not None:
        from dataclasses import replace

        align = replace(strategy.align, steps=args.align_steps)
    with _writer(args.tb) as writer:
        if selection is not None:
            log_selection(selection["scores"], keep, writer)
        student, report = calibrate_student(
            teacher.model, keep, strategy, calib_batches=batches, heldout_batches=heldout, stats=stats,
            teacher_sha256=teacher.sha256, align=align, writer=writer if args.tb else None,
            progress=not args.no_progress,
            seed=args.seed,
            meta={"seq_len": args.seq_len, **source.describe(), **_bos_record(args, bos_id)},
        )
        report.update(_bos_record(args, bos_id))
        report.update(source.describe())
        report.update(teacher_sha256=teacher.sha256, tokens=args.tokens, seq_len=args.seq_len, selection=selection,
                      converted=converted_layers(pattern_from_keep(len(teacher.model.layers), keep)))
        _write_outputs(args, student, report, teacher, bos_id, writer)
    return 0


def _write_outputs(args, student, report: dict, teacher, bos_id: int | None, writer) -> None:
    """The student's perplexity on --eval-text into `report`, the checkpoint and its report into
    --out, and the report (without the alignment curves when they went to --out) to stdout."""
    if args.eval_text:
        from megatron_tc.eval.perplexity import evaluate_text

        result = evaluate_text(lambda ids: student(ids), args.eval_text, teacher.tokenizer, args.seq_len,
                               args.eval_tokens, progress=not args.no_progress, bos_id=bos_id)
        report["eval"] = {"text": os.path.abspath(args.eval_text), "ppl": result.ppl, "tokens": result.tokens}
        writer.scalar("eval/ppl", result.ppl, 0)
    if args.out:
        from megatron_tc.convert.checkpoint import save_checkpoint

        source = {"calibrate": {k: v for k, v in report.items() if k != "align"}, "teacher": teacher.path}
        save_checkpoint(student.state_dict(), student.arch, args.out, source=source,
                        tokenizer_files=teacher.tokenizer_files, overwrite=True)
        (Path(args.out) / "calibrate_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report if args.out is None else {k: report[k] for k in report if k != "align"}, indent=1))


def _ga_stats(teacher, batches, args, bos_id: int | None, source) -> TaylorStats:
    """Statistics of every layer for ga's probe students (their init's readout sums)."""
    arch = teacher.model.arch
    strategy = get_strategy(args.init or "taylor_calibrate")
    return collect_stats(teacher.model, batches, list(range(arch.num_layers)), _meta(args, teacher, bos_id, source),
                         readout_strategies=[strategy] if strategy.needs_readout else [],
                         student_arch=arch.with_pattern("G" * arch.num_layers), progress=not args.no_progress)


@_user_errors
def select_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="choose the layers kept as softmax attention; writes JSON")
    _data_args(ap)
    ap.add_argument("--policy", required=True, choices=POLICY_CHOICES,
                    help="stats is readout_gap (the name model.policy gives it)")
    ap.add_argument("--num-keep", type=int, default=0, help="default: a quarter of the layers")
    ap.add_argument("--stats", default=None,
                    help="stats file (required by stats/readout_gap; optional init stats for ar/ga)")
    ap.add_argument("--init", default=None,
                    help="ga: init of the one-layer-kept probe students (default taylor_calibrate, aligned, as its "
                         "authors); ar: convert the layer with this init instead of bypassing its attention")
    ap.add_argument("--rounds", type=int, default=1, help="ga: 1 = one ranking, K = forward greedy")
    ap.add_argument("--out", required=True, help="JSON file: keep, scores, details")
    args = ap.parse_args(argv)
    _check_paths(args)
    source = open_source(args)
    _refuse_overlap(args, source)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher = load_teacher(args.teacher)
    stats = TaylorStats.load(args.stats, teacher_sha256=teacher.sha256) if args.stats else None
    _refuse_overlap(args, source, stats)
    bos_id = _bos_id(args, teacher)
    batches = _batches(source, teacher, args, bos_id)
    num_keep = args.num_keep or max(1, round(teacher.model.arch.num_layers / 4))
    extra = {}
    if args.policy in ("ar", "ga"):
        extra = {"teacher_sha256": teacher.sha256}
        if args.init is not None or args.policy == "ar":
            extra["init"] = args.init
        if args.policy == "ga":
            extra["rounds"] = args.rounds
            stats = stats or _ga_stats(teacher, batches, args, bos_id, source)
        if not args.no_progress:
            from megatron_tc.monitor import progress

            extra["progress"] = lambda xs: progress(xs, desc=args.policy, unit="student")
    sel = select_layers(args.policy, num_keep, teacher=teacher.model, stats=stats, batches=batches, **extra)
    with _writer(args.tb) as writer:
        log_selection(sel.scores, sel.keep, writer)
    out = sel.to_json() | {"teacher_sha256": teacher.sha256, **source.describe(), "tokens": args.tokens,
                           **_bos_record(args, bos_id)}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(json.dumps({"policy": sel.policy, "keep": sel.keep}))
    return 0
