"""Workers of tests/parallel/test_sharded_teacher.py: a teacher loaded split over TP=2 ranks from a
checkpoint (parallel.sharded_teacher), against the replicated teacher of the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.parallel._workers_stats import READOUT, row_batches, tiny_teacher_and_rows


def save_tiny_teacher(out: Path, tp: int = 1) -> Path:
    """The statistics tests' 3-layer GQA teacher as a megatron_tc checkpoint with `tp` shards."""
    from megatron_tc.convert.checkpoint import save_checkpoint

    model, _, _ = tiny_teacher_and_rows()
    return save_checkpoint(model.state_dict(), model.arch, out, tp=tp)


def _sharded(ckpt: str):
    from megatron_tc.parallel.sharded_teacher import load_tensor_parallel
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(tp=2)
    return ctx, load_tensor_parallel(ckpt, ctx)


def load_and_forward(rank: int, world_size: int, ckpt: str, out: str, bad_ckpt: str, damaged_ckpt: str) -> None:
    """Rank r saves its sharded teacher's state, the state apply_tensor_parallel cuts from the
    whole teacher in memory (the reference), the gathered logits of all 4 rows and the
    whole-teacher hash streamed from the checkpoint; then tries `bad_ckpt` (`_bad_tp`)."""
    from megatron_tc.calibrate.teacher_io import checkpoint_weights_sha256
    from megatron_tc.convert.layout import resize_vocab
    from megatron_tc.model import HybridLM
    from megatron_tc.parallel.tensor_parallel import apply_tensor_parallel, gather_vocab_shards

    from megatron_tc.convert.lazy import track_reads

    with track_reads() as reads:
        ctx, model = _sharded(ckpt)
    whole, ids, doc_ids = tiny_teacher_and_rows()
    state, arch = resize_vocab(whole.state_dict(), whole.arch, model.arch.padded_vocab_size)
    reference = HybridLM(arch)
    reference.load_state_dict(state)
    apply_tensor_parallel(reference, ctx)
    with torch.no_grad():
        logits = gather_vocab_shards(model(ids, doc_ids=doc_ids), model.arch.vocab_size, ctx)
    record = {"state": model.state_dict(), "reference": reference.state_dict(), "logits": logits,
              "padded": model.arch.padded_vocab_size, "sha256": checkpoint_weights_sha256(ckpt),
              "read_bytes": reads.read_bytes}
    record.update(select_and_score(model, ckpt, ctx))
    torch.save(record, f"{out}.{rank}")
    _bad_tp(rank, bad_ckpt, out)
    _damaged_shard(rank, damaged_ckpt if rank == 1 else ckpt, out)
    dist.barrier()


GA_ALIGN_STEPS = 3  # the authors' 300 probe alignment steps, shortened for the tests


def select_and_score(teacher, ckpt: str | None = None, ctx=None) -> dict:
    """The `ar` and `ga` selections (keep 2 of 3 layers; ga's probes taylor_calibrate students with
    GA_ALIGN_STEPS alignment steps) and the eval stage's scores of the naive GAG student against
    `teacher` over the 4 rows (batches of 2 windows; a second call from the teacher cache). With
    a ParallelContext `ctx` the teacher is split over its TP group and the students are built from
    the checkpoint `ckpt`."""
    from dataclasses import replace

    from megatron_tc.calibrate import strategies
    from megatron_tc.calibrate.policies import attention_removal, greedy_addition
    from megatron_tc.calibrate.stats import collect_stats
    from megatron_tc.calibrate.student import build_student
    from megatron_tc.calibrate.teacher_io import Teacher, whole_teacher_state
    from megatron_tc.distill.evaluation import TeacherCache, score_rows

    _, ids, doc_ids = tiny_teacher_and_rows()
    batches = row_batches(ids, doc_ids, range(4))
    tp_group, dp_group = (None, None) if ctx is None else (ctx.tp_group, ctx.dp_group)
    state = None if tp_group is None else whole_teacher_state(Teacher(teacher, "t", None, {}, ckpt, tp_group=tp_group))
    ar = attention_removal(teacher, 2, batches, tp_group=tp_group)
    stats = collect_stats(teacher, batches, [0, 1, 2], {"teacher_sha256": "t"},
                          readout_strategies=[strategies.get_strategy("taylor")],
                          student_arch=teacher.arch.with_pattern("GGG"), dp_group=dp_group, tp_group=tp_group,
                          progress=False)
    paper = strategies.PAPER_GA_ALIGN
    strategies.PAPER_GA_ALIGN = replace(paper, steps=GA_ALIGN_STEPS)
    try:
        ga = greedy_addition(teacher, 2, batches, stats=stats, teacher_sha256="t", tp_group=tp_group, teacher_state=state)
    finally:
        strategies.PAPER_GA_ALIGN = paper
    student = build_student(teacher, "GAG", "naive", teacher_state=state)
    rows, cache = [ids[i:i + 1] for i in range(4)], TeacherCache()
    scores = [score_rows(lambda x: student(x), lambda x: teacher(x), rows, 0, 1, cache=cache, batch_size=2,
                         vocab_size=teacher.arch.vocab_size, teacher_tp_group=tp_group) for _ in range(2)]
    return {"ar": ar.to_json(), "ga": ga.to_json(), "eval": scores}


def stats(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """Both statistics sweeps on the sharded teacher, with the layers kept from sweep 1 and with a
    second forward (budget 0); rank 0 saves them as {out}.kept and {out}.forward."""
    from megatron_tc.calibrate.stats import collect_stats
    from megatron_tc.calibrate.strategies import get_strategy

    ctx, model = _sharded(ckpt)
    _, ids, doc_ids = tiny_teacher_and_rows()
    for name, budget in (("kept", None), ("forward", 0)):
        result = collect_stats(model, row_batches(ids, doc_ids, range(4)), [0, 2],
                               {"teacher_sha256": "t", "seq_len": 24}, readout_strategies=[get_strategy(s) for s in READOUT],
                               student_arch=model.arch.with_pattern("GAG"), chunk_size=5, dp_group=ctx.dp_group,
                               tp_group=ctx.tp_group, progress=False, io_cache_budget=budget)
        if rank == 0:
            result.save(f"{out}.{name}")
    dist.barrier()


def closed_form_student(teacher, teacher_state=None, ctx=None):
    """taylor_fit's closed form (statistics and readout fit over all 4 rows) for layers 0 and 2
    of the GAG split, without alignment: (student, report)."""
    from megatron_tc.calibrate.student import calibrate_student

    _, ids, doc_ids = tiny_teacher_and_rows()
    return calibrate_student(teacher, [1], "taylor_fit", calib_batches=row_batches(ids, doc_ids, range(4)),
                             teacher_sha256="t", align=False, dp_group=ctx and ctx.dp_group,
                             tp_group=ctx and ctx.tp_group, teacher_state=teacher_state, progress=False)


def alignment_targets(teacher) -> dict:
    """What per-layer alignment trains on: the teacher's mixer inputs and outputs at layers 0 and 2."""
    from megatron_tc.calibrate.align import collect_layer_io

    _, ids, doc_ids = tiny_teacher_and_rows()
    data = collect_layer_io(teacher, row_batches(ids, doc_ids, range(4)), [0, 2], keep_resid=True)
    return {layer: {"x": d.x, "y": d.y, "resid": d.resid} for layer, d in data.items()}


def init_student(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """The zero-shot student built from the sharded teacher (statistics, student weights read
    from the checkpoint) and the alignment targets it gives; rank r saves them."""
    from megatron_tc.calibrate.teacher_io import Teacher, whole_teacher_state

    ctx, model = _sharded(ckpt)
    teacher = Teacher(model, "t", None, {}, ckpt, tp_group=ctx.tp_group)
    student, _ = closed_form_student(model, whole_teacher_state(teacher), ctx)
    torch.save({"state": student.state_dict(), "targets": alignment_targets(model)}, f"{out}.{rank}")
    dist.barrier()


def _bad_tp(rank: int, ckpt: str, out: str) -> None:
    """A teacher with 3 heads loaded over TP=2: each rank writes the error it got to {out}.error.{rank}."""
    from megatron_tc.parallel.sharded_teacher import load_tensor_parallel
    from megatron_tc.parallel.state import current_context

    try:
        load_tensor_parallel(ckpt, current_context())
        message = "loaded"
    except Exception as err:  # the test reads the message each rank got
        message = f"{type(err).__name__}: {err}"
    Path(f"{out}.error.{rank}").write_text(message)


def _damaged_shard(rank: int, ckpt: str, out: str) -> None:
    """{out}.damaged.{rank}: what this rank's own read of `ckpt` (this rank's copy of the teacher)
    gives ("alone": no collective) and what the teacher's load (`load_sharded_teacher`) raises
    ("shared")."""
    from megatron_tc.calibrate.teacher_io import load_sharded_teacher
    from megatron_tc.parallel.sharded_teacher import load_tensor_parallel
    from megatron_tc.parallel.state import current_context

    got = {}
    for key, load in (("alone", load_tensor_parallel), ("shared", load_sharded_teacher)):
        try:
            load(ckpt, current_context())
            got[key] = "loaded"
        except Exception as err:  # the test reads the message each rank got
            got[key] = f"{type(err).__name__}: {err}"
    Path(f"{out}.damaged.{rank}").write_text(json.dumps(got))


def stage2(rank: int, world_size: int, out: str) -> None:
    """Stage 2 (2 steps) and stage 1 (3 steps) with the teacher loaded split over TP=2 from a
    checkpoint of the padded teacher (rank 0 writes it); out/tp2_sharded and out/s1_tp2_sharded
    get the logs and the gathered students."""
    from megatron_tc.convert.checkpoint import save_checkpoint
    from tests.parallel import _workers_distill_tp as tp_workers

    ckpt = Path(out) / "teacher_ckpt"
    if rank == 0:
        teacher = tp_workers.padded_teacher(tp_workers.teacher_and_student(0)[0])
        save_checkpoint(teacher.state_dict(), teacher.arch, ckpt)
    dist.barrier()
    tp_workers.run_stage2(Path(out) / "tp2_sharded", 2, steps=STAGE2_STEPS, teacher_ckpt=ckpt)
    tp_workers.run_stage1(Path(out) / "s1_tp2_sharded", 2, teacher_ckpt=ckpt)


def stage2_reference(rank: int, world_size: int, out: str) -> None:
    from tests.parallel import _workers_distill_tp as tp_workers

    tp_workers.run_stage2(Path(out) / "tp1", 1, steps=STAGE2_STEPS)
    tp_workers.run_stage1(Path(out) / "s1_tp1", 1)


STAGE2_STEPS = 2
