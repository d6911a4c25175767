"""The statistics pass runs the teacher once per batch: sweep 2 reads the layer inputs and outputs
sweep 1 kept, and its sums equal those of a second teacher forward bit for bit."""
import torch

from megatron_tc.calibrate.stats import collect_stats, layer_io_bytes
from megatron_tc.calibrate.strategies import get_strategy
from tests.parallel._workers_stats import READOUT, row_batches, tiny_teacher_and_rows

LAYERS = [0, 2]


def stats_and_forwards(io_cache_budget):
    model, ids, doc_ids = tiny_teacher_and_rows()
    batches = row_batches(ids, doc_ids, range(4))
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    stats = collect_stats(model, batches, LAYERS, {"teacher_sha256": "t", "seq_len": 24},
                          readout_strategies=[get_strategy(s) for s in READOUT],
                          student_arch=model.arch.with_pattern("GAG"), chunk_size=5, progress=False,
                          io_cache_budget=io_cache_budget)
    return stats, len(forwards), layer_io_bytes(model, batches, LAYERS)


def test_one_teacher_forward_per_batch_and_the_same_sums_as_two():
    cached, cached_forwards, needed = stats_and_forwards(None)
    assert needed == 2 * 4 * 24 * len(LAYERS) * 32 * 4  # x and out, 4 rows x 24 tokens, hidden 32, fp32
    twice, twice_forwards, _ = stats_and_forwards(0)  # no room for the cache: sweep 2 runs the teacher again
    assert (cached_forwards, twice_forwards) == (4, 8)
    assert any(key.startswith("readout.") for key in cached.sums)
    assert cached.sums.keys() == twice.sums.keys()
    for key, value in twice.sums.items():
        assert torch.equal(cached.sums[key], value), key
    assert cached.meta == twice.meta


def test_the_budget_decides_exactly_at_the_cache_size():
    needed = 2 * 4 * 24 * len(LAYERS) * 32 * 4
    assert stats_and_forwards(needed)[1] == 4
    assert stats_and_forwards(needed - 1)[1] == 8
