"""Workers of tests/parallel/test_stats_dp.py (spawned processes import them from here)."""
import torch
import torch.distributed as dist

from megatron_tc.calibrate.stats import collect_stats
from megatron_tc.calibrate.strategies import get_strategy
from megatron_tc.model import ArchConfig, HybridLM

READOUT = ("taylor", "taylor_fit", "taylor_fit-closed")


def tiny_teacher_and_rows():
    """A seeded 3-layer GQA teacher and 4 rows of 24 tokens with packed documents."""
    arch = ArchConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, padded_vocab_size=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = HybridLM(arch).eval()
        ids = torch.randint(0, 97, (4, 24))
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24, [5] * 3 + [6] * 21, [2] * 24])
    return model, ids, doc_ids


def row_batches(ids, doc_ids, rows):
    """One batch per row of `rows`."""
    return [{"input_ids": ids[r:r + 1], "doc_ids": doc_ids[r:r + 1]} for r in rows]


def stats_of_rows(rows, dp_group=None):
    model, ids, doc_ids = tiny_teacher_and_rows()
    batches = row_batches(ids, doc_ids, rows)
    return collect_stats(model, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24},
                         readout_strategies=[get_strategy(s) for s in READOUT],
                         student_arch=model.arch.with_pattern("GAG"), chunk_size=5, dp_group=dp_group, progress=False)


def dp_stats(rank: int, world_size: int, out_path: str, rank0_only: bool = False) -> None:
    """rank0_only: every row on rank 0, none on the others (more ranks than calibration rows)."""
    rows = ([r for r in range(4) if r % world_size == rank] if not rank0_only
            else list(range(4)) if rank == 0 else [])
    stats = stats_of_rows(rows)
    if rank == 0:
        stats.save(out_path)
    dist.barrier()


def _tp2_teacher_and_batches():
    """(ctx, the tiny teacher sharded over TP=2, a batch per row of all 4 rows)."""
    from megatron_tc.parallel.state import init_parallel
    from megatron_tc.parallel.tensor_parallel import apply_tensor_parallel

    ctx = init_parallel(tp=2)
    model, ids, doc_ids = tiny_teacher_and_rows()
    apply_tensor_parallel(model, ctx)
    return ctx, model, row_batches(ids, doc_ids, range(4))


def tp_stats(rank: int, world_size: int, out_path: str) -> None:
    """The tiny teacher sharded over TP=2; attention sweep over all rows; rank 0 saves."""
    from megatron_tc.calibrate.stats import collect_attention_stats

    ctx, model, batches = _tp2_teacher_and_batches()
    stats = collect_attention_stats(model, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24}, chunk_size=5,
                                    dp_group=ctx.dp_group, tp_group=ctx.tp_group, progress=False)
    if rank == 0:
        stats.save(out_path)
    dist.barrier()


def tp_full_stats(rank: int, world_size: int, out_path: str, unequal_budgets: bool = False) -> None:
    """Both sweeps with the teacher sharded over TP=2 (readout on gathered layers); rank 0 saves.
    unequal_budgets: only rank 0's layer-I/O budget holds the kept layers (as on GPUs of different
    memory), so the ranks must agree on one way to run sweep 2."""
    ctx, model, batches = _tp2_teacher_and_batches()
    budget = None if not unequal_budgets else 1 << 40 if rank == 0 else 0
    stats = collect_stats(model, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24},
                          readout_strategies=[get_strategy(s) for s in READOUT],
                          student_arch=model.arch.with_pattern("GAG"), chunk_size=5, dp_group=ctx.dp_group,
                          tp_group=ctx.tp_group, progress=False, io_cache_budget=budget)
    assert type(model).__name__ == "TensorParallelHybridLM"  # the caller's teacher stays sharded
    if rank == 0:
        stats.save(out_path)
    dist.barrier()


def student_forced_alignment(rank: int, world_size: int, out_path: str) -> None:
    """taylor_fit-seqres aligned with the layers split over the ranks (owner aligns, broadcast before
    the stream moves on); rank 0 saves every rank's student state and the per-layer reports."""
    student, report = student_forced_student(dp_group=dist.group.WORLD)
    states = [None] * world_size
    dist.all_gather_object(states, {k: v.clone() for k, v in student.state_dict().items()})
    if rank == 0:
        torch.save({"states": states, "align": report["align"]}, out_path)
    dist.barrier()


def student_forced_student(dp_group=None):
    """The 3-layer teacher's GAG student, taylor_fit-seqres with a short alignment, rows 0-2 to train
    on and row 3 held out."""
    from megatron_tc.calibrate.strategies import AlignSettings
    from megatron_tc.calibrate.student import calibrate_student

    model, ids, doc_ids = tiny_teacher_and_rows()
    batches = row_batches(ids, doc_ids, range(4))
    settings = AlignSettings(steps=6, lr_gates=1e-2, lr_proj=1e-3, eval_every=2, best_on="heldout", forcing="residual")
    return calibrate_student(model, [1], "taylor_fit-seqres", calib_batches=batches[:3], heldout_batches=batches[3:],
                             stats=stats_of_rows(range(4)), teacher_sha256="t", align=settings, dp_group=dp_group,
                             progress=False)
