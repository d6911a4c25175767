"""Workers of tests/parallel/test_comm.py (gloo) and tests/gpu/test_comm_nccl.py (NCCL): the
collectives of megatron_tc.parallel.comm on tensors that live on the CPU or on the rank's GPU."""
import torch
import torch.distributed as dist

from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.parallel.comm import all_gather, all_reduce_, broadcast_, comm_device


def _device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def collectives_keep_the_callers_device(rank: int, world_size: int, kind: str = "cpu") -> None:
    """kind: where the caller's tensors live ('cpu' under gloo or NCCL; 'cuda' under NCCL)."""
    dev = _device(kind)
    backend = dist.get_backend()
    want = dev if backend == "gloo" or kind == "cuda" else torch.device("cuda", torch.cuda.current_device())
    assert comm_device(torch.zeros(1, device=dev)) == want, (backend, kind, comm_device(torch.zeros(1, device=dev)))

    base = torch.arange(12, dtype=torch.float64, device=dev).view(3, 4) * (rank + 1)
    view = base.t()  # a non-contiguous view: the result must land in `base`'s storage
    assert all_reduce_(view) is view
    factor = sum(r + 1 for r in range(world_size))
    assert base.device == dev
    assert torch.equal(base.cpu(), torch.arange(12, dtype=torch.float64).view(3, 4) * factor)

    flag = torch.tensor([float(rank)], device=dev)
    all_reduce_(flag, dist.ReduceOp.MIN)
    assert flag.item() == 0.0

    parts = all_gather(torch.full((2,), float(rank), dtype=torch.float64, device=dev))
    assert [p.device for p in parts] == [dev] * world_size
    assert [p.tolist() for p in parts] == [[float(r)] * 2 for r in range(world_size)]

    src = world_size - 1
    shared = torch.full((3,), float(rank), device=dev)
    broadcast_(shared, src=src)
    assert shared.device == dev and shared.tolist() == [float(src)] * 3

    # the statistics pass's fp64 sums on the caller's device (the failure of the first GPU run)
    stats = TaylorStats({"layers": [0]}, {"layers.0.count": torch.tensor(float(rank + 1), dtype=torch.float64,
                                                                          device=dev),
                                          "layers.0.x": torch.ones(2, 3, dtype=torch.float64, device=dev)})
    stats.all_reduce_()
    assert stats.meta["tokens"] == factor
    assert stats.sums["layers.0.x"].device == dev
    assert torch.equal(stats.sums["layers.0.x"].cpu(), torch.full((2, 3), float(world_size), dtype=torch.float64))


def stats_with_teacher_on_gpu(rank: int, world_size: int, out_path: str) -> None:
    """tests/parallel/_workers_stats.dp_stats with the teacher on this rank's GPU and the batches
    on the CPU (capture_layers moves them); rank 0 saves."""
    from tests.parallel._workers_stats import READOUT, tiny_teacher_and_rows

    from megatron_tc.calibrate.stats import collect_stats
    from megatron_tc.calibrate.strategies import get_strategy

    torch.backends.cuda.matmul.allow_tf32 = False
    model, ids, doc_ids = tiny_teacher_and_rows()
    model.to(_device("cuda"))
    rows = [r for r in range(4) if r % world_size == rank]
    batches = [{"input_ids": ids[r:r + 1], "doc_ids": doc_ids[r:r + 1]} for r in rows]
    stats = collect_stats(model, batches, [0, 2], {"teacher_sha256": "t", "seq_len": 24},
                          readout_strategies=[get_strategy(s) for s in READOUT],
                          student_arch=model.arch.with_pattern("GAG"), chunk_size=5, progress=False)
    assert all(v.device.type == "cpu" for v in stats.sums.values())
    if rank == 0:
        stats.save(out_path)
    dist.barrier()
