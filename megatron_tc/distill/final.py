"""The closing stages: eval (the comparison table) and export (HF + megatron_tc).

eval scores, on the held-out evaluation windows, the teacher, the naive zero-shot conversion, the
configured init's zero-shot student and each trained student that exists (after stage 1, after
stage 2): perplexity, KL(teacher || student) per token and top-1 agreement. Windows are spread
over data-parallel ranks (plain replicated modules; sums all-reduced). A teacher split over the
tensor-parallel ranks (parallel.shard_teacher) stays split: its terms come from its vocabulary
shards, the students are whole on every rank. From stage 2's evaluations (the run's eval log) it
reads the stage-2 tokens to each `eval.target_ppl_factors` x the teacher's perplexity, and with
`eval.probe_lengths` it runs the long-context probe (`eval.long_context`) on rank 0.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_tc.distill.context import RunContext
from megatron_tc.parallel.comm import all_ranks
from megatron_tc.parallel.state import shared_outcome
from megatron_tc.distill.evaluation import TeacherCache, eval_batch_size, score_rows, window_rows
from megatron_tc.distill.rundir import write_json
from megatron_tc.monitor import get_logger

log = get_logger(__name__)


def final_student_dir(ctx: RunContext) -> Path:
    """The most trained student that exists: stage 2, else stage 1, else the zero-shot init."""
    for stage in ("stage2", "stage1"):
        if (ctx.paths.student(stage) / "manifest.json").is_file():
            return ctx.paths.student(stage)
    if (ctx.paths.init_student / "manifest.json").is_file():
        return ctx.paths.init_student
    raise FileNotFoundError(f"no student in {ctx.paths.root}: run the init stage (and stage2) first")


def _load(path: Path, device: torch.device):
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    return load_hybrid_lm(path, device=device)


def run_eval(ctx: RunContext) -> dict[str, Any]:
    """-> eval/results.json and eval/results.md: one row per model."""
    from megatron_tc.distill.stages import build_naive_student

    cfg, device = ctx.cfg, ctx.device
    loaded = ctx.teacher()
    teacher = loaded.model.to(device)
    rows = window_rows(ctx.eval_windows())
    candidates: list[tuple[str, Any]] = [("naive zero-shot", None)]
    init_name = _init_name(ctx)
    if init_name != "naive":
        candidates.append((f"{init_name} zero-shot", ctx.paths.init_student))
    for stage, label in (("stage1", "after stage 1"), ("stage2", "after distillation")):
        if (ctx.paths.student(stage) / "manifest.json").is_file():
            candidates.append((label, ctx.paths.student(stage)))
    results = []
    par = ctx.par
    memo, key = _memo(ctx, loaded, rows)
    cache = memo.teacher_cache(key) if memo else TeacherCache()
    teacher_fn = lambda ids: teacher(ids)  # noqa: E731
    for label, path in candidates:
        scores = _agreed(memo.recall(key, path) if memo and path is not None else None)
        if scores is not None:  # stage 2 of this process scored this checkpoint on these rows
            log.info("eval %s: the scores stage 2 computed for %s", label, path)
        else:
            model = build_naive_student(ctx).to(device) if path is None else _load(path, device)
            scores = score_rows(lambda ids: model(ids), teacher_fn, rows, par.dp_rank, par.dp_size, par.dp_group,
                                device, cache, vocab_size=teacher.arch.vocab_size, batch_size=eval_batch_size(cfg),
                                teacher_tp_group=loaded.tp_group)
            del model
        if not results:  # the teacher's own perplexity comes with the first comparison
            results.append({"model": "teacher", "ppl": scores["teacher_ppl"], "kl": 0.0, "top1_agree": 1.0,
                            "path": str(ctx.paths.teacher)})
        results.append({"model": label, "ppl": scores["ppl"], "kl": scores["kl"], "top1_agree": scores["top1_agree"],
                        "path": str(path) if path else "(built in memory)"})
    summary = {"eval_tokens": scores["tokens"], "seq_len": rows[0].shape[1], "windows": len(rows),
               "documents": ctx.data().manifest.names("eval"), **ctx.data().bos_record(), "rows": results}
    reached = tokens_to_targets(ctx.paths.eval_log, results[0]["ppl"], cfg.eval.target_ppl_factors)
    if reached is not None:
        summary["tokens_to_target"] = reached
    if cfg.eval.probe_lengths:
        summary["long_context"] = run_long_context_probe(ctx, final_student_dir(ctx))
    if ctx.rank0:
        write_json(ctx.paths.results, summary)
        table = format_table(summary)
        (ctx.paths.results.parent / "results.md").write_text(table + "\n")
        ctx.tb.text("eval/results", table.replace("\n", "  \n"))
        log_eval_scalars(ctx.tb, summary)
        for i, row in enumerate(results):
            log.info("eval %-28s ppl %10.3f  kl %.4f", row["model"], row["ppl"], row["kl"])
    ctx.barrier()
    return {"rows": {r["model"]: round(r["ppl"], 3) for r in results}}


def log_eval_scalars(tb: Any, summary: dict[str, Any]) -> None:
    """The eval stage's numbers as TensorBoard scalars: `eval/<model>/{ppl,kl,top1_agree}`,
    `eval/tokens_to_target/<k>x` and `long_context/<model>/accuracy` over the context length."""
    for row in summary["rows"]:
        name = row["model"].replace(" ", "_")
        tb.scalars({key: row[key] for key in ("ppl", "kl", "top1_agree")}, 0, prefix=f"eval/{name}")
    for target in summary.get("tokens_to_target") or []:
        if target["tokens"] is not None:
            tb.scalar(f"eval/tokens_to_target/{target['k']:g}x", target["tokens"], 0)
    if summary.get("long_context"):
        from megatron_tc.eval.long_context import log_accuracy

        log_accuracy(tb, summary["long_context"]["accuracy"])


def tokens_to_targets(eval_log: Path, teacher_ppl: float, factors: list[float]) -> list[dict[str, Any]] | None:
    """For each k in `factors`: the stage-2 tokens at which the student's held-out perplexity first
    reached k x `teacher_ppl` (interpolated between evaluations; None: not reached), from stage 2's
    eval log; None when stage 2 logged no evaluations."""
    from megatron_tc.eval.tokens_to_target import EvalLogError, read_jsonl_log, tokens_to_reach

    if not eval_log.is_file() or not eval_log.read_text().strip():
        return None
    try:
        curve = read_jsonl_log(eval_log)
    except EvalLogError as err:  # the table does not depend on it: said, not fatal
        log.warning("tokens to target not reported: %s", err)
        return None
    return [{"k": k, "target_ppl": k * teacher_ppl, "tokens": tokens_to_reach(curve, k * teacher_ppl),
             "last_tokens": curve.final_tokens} for k in factors]


PROBE_SAMPLES = 20  # examples per length, as `python -m megatron_tc.eval.long_context` takes by default


def run_long_context_probe(ctx: RunContext, student_dir: Path) -> dict[str, Any] | None:
    """The associative-recall probe at `eval.probe_lengths` for the teacher and the final student,
    on rank 0 (greedy decoding with each model's cache) -> <run_dir>/long_context.json, where
    tools/report.py finds it; returns the accuracies (None on the other ranks). A teacher split
    over the tensor-parallel ranks is not loaded whole for it: the student alone is probed."""
    from megatron_tc.data.bos import bos_record, resolve_bos_id
    from megatron_tc.eval.loading import load_model
    from megatron_tc.eval.long_context import make_examples, run_probe

    cfg, device, out = ctx.cfg, ctx.device, None
    tokenizer = ctx.teacher_meta().tokenizer  # the student's too
    bos_id = resolve_bos_id(tokenizer, cfg.data.bos)
    try:  # on every rank: a bad length stops them all with the same line
        examples = make_examples(tokenizer, cfg.eval.probe_lengths, PROBE_SAMPLES, seed=cfg.run.seed, bos_id=bos_id)
    except ValueError as err:  # a context too short for this tokenizer's key-value lines
        from megatron_tc.config import ConfigError

        raise ConfigError(f"eval.probe_lengths={cfg.eval.probe_lengths}: {err}") from None
    if ctx.rank0:
        dtype = "bfloat16" if device.type == "cuda" and cfg.run.precision == "bf16" else "float32"
        models = {"student": load_model(student_dir, device, dtype)}
        if not ctx.shard_teacher():
            models = {"teacher": load_model(ctx.paths.teacher, device, dtype), **models}
        result = run_probe(models, examples, method="generate", device=device, progress=cfg.logging.progress_bar)
        result.update(model=str(student_dir), teacher=str(ctx.paths.teacher) if "teacher" in models else None,
                      **bos_record(bos_id, cfg.data.bos))
        write_json(ctx.paths.root / "long_context.json", result)
        out = {"lengths": result["lengths"], "accuracy": result["accuracy"]}
        for name, accuracy in result["accuracy"].items():
            log.info("long-context probe, %s: %s", name, ", ".join(f"{L}: {a:.2f}" for L, a in accuracy.items()))
    ctx.barrier()
    return out


def _memo(ctx: RunContext, loaded: Any, rows: list[torch.Tensor]):
    """(the run's EvalMemo, the rows' key) when this teacher computes as stage 2's shared one
    (fp32, whole), else (None, None)."""
    from megatron_tc.distill.eval_memo import EvalMemo, computes_like_eval_stage

    if loaded.tp_group is not None or not computes_like_eval_stage(loaded.model):
        return None, None
    return ctx.eval_memo(), EvalMemo.rows_key(rows, eval_batch_size(ctx.cfg), ctx.par.dp_rank, ctx.par.dp_size)


def _agreed(scores: dict[str, Any] | None) -> dict[str, Any] | None:
    """`scores` when every rank has remembered scores, else None on every rank (scoring is collective)."""
    return scores if all_ranks(scores is not None) else None


def _init_name(ctx: RunContext) -> str:
    import json

    report = ctx.paths.init_student.parent / "report.json"
    if report.is_file():
        return json.loads(report.read_text()).get("init", ctx.cfg.calibrate.init)
    return ctx.cfg.calibrate.init


def format_table(summary: dict[str, Any]) -> str:
    bos = " (each starting with BOS)" if summary.get("bos") else ""
    lines = [f"Held-out evaluation: {summary['eval_tokens']} predicted tokens in {summary['windows']} windows of "
             f"{summary['seq_len']} tokens{bos}",
             "",
             "| model | perplexity | KL(teacher‖student) | top-1 agreement |",
             "|---|---:|---:|---:|"]
    for row in summary["rows"]:
        ppl = f"{row['ppl']:.2f}" if math.isfinite(row["ppl"]) else "inf"
        lines.append(f"| {row['model']} | {ppl} | {row['kl']:.4f} | {row['top1_agree']:.3f} |")
    targets = summary.get("tokens_to_target") or []
    if targets:
        lines.append("")
    for target in targets:
        reached = (f"{target['tokens']:,.0f}" if target["tokens"] is not None
                   else f"not reached in {target['last_tokens']:,.0f}")
        lines.append(f"Stage-2 tokens to {target['k']:g}x the teacher's perplexity ({target['target_ppl']:.2f}): "
                     f"{reached}")
    probe = summary.get("long_context")
    if probe:
        lines.append("\nLong-context probe (accuracy by context length, long_context.json):")
        lines += [f"- {name}: " + ", ".join(f"{L}: {a:.2f}" for L, a in acc.items())
                  for name, acc in probe["accuracy"].items()]
    return "\n".join(lines)


def run_export(ctx: RunContext) -> dict[str, Any]:
    """The final student -> export/hf (AutoModelForCausalLM after `import megatron_tc`) and
    export/megatron_tc (sharded for parallel.tp x parallel.pp), each written by one rank."""
    from megatron_tc.convert.checkpoint import reshard
    from megatron_tc.convert.export import export_to_hf

    source = final_student_dir(ctx)
    bar = ctx.cfg.logging.progress_bar
    writers = {"hf": lambda dst: export_to_hf(source, dst, overwrite=True, progress=bar),
               "megatron_tc": lambda dst: reshard(source, dst, ctx.cfg.parallel.tp, ctx.cfg.parallel.pp, overwrite=True,
                                                  progress=bar)}
    formats = [f for f in ctx.cfg.export.formats if f in writers]
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = [fmt for i, fmt in enumerate(formats) if i % world == ctx.par.rank]  # each format one rank's write

    def write() -> None:
        for fmt in mine:
            writers[fmt](ctx.paths.export / fmt)

    shared_outcome(write if mine else None)  # a format that cannot be written stops every rank with its line
    out: dict[str, Any] = {"source": str(source), **{f: str(ctx.paths.export / f) for f in formats}}
    if ctx.rank0:
        log.info("exported %s -> %s", source, ", ".join(f"{k}: {v}" for k, v in out.items() if k != "source"))
    return out


def export_outputs(ctx_paths: Any, formats: list[str]) -> list[Path]:
    return [ctx_paths.export / f for f in formats]
