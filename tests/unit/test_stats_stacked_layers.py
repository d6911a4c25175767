"""Sweep 1 sums several layers of a batch in one call, their heads stacked: the same sums as a call
per layer, full and sliding-window layers in calls of their own, the stack bounded by its memory."""
import pytest
import torch

from megatron_tc.calibrate import moments, sweep_attention
from megatron_tc.calibrate import stats as stats_module
from megatron_tc.calibrate.stats import collect_attention_stats, stacked_layers
from megatron_tc.model import ArchConfig, HybridLM

KINDS = ["sliding", "full", "sliding", "sliding", "full", "full"]


def teacher() -> HybridLM:
    arch = ArchConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=len(KINDS), num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, padded_vocab_size=128, sliding_window=5,
                      attn_layer_types=KINDS)
    torch.manual_seed(11)
    return HybridLM(arch).double().eval()


def batches(documents: bool) -> list[dict]:
    torch.manual_seed(12)
    out = []
    for ids in torch.randint(0, 97, (3, 2, 16)):
        doc_ids = torch.tensor([[0] * 6 + [1] * 10, [3] * 16])
        out.append({"input_ids": ids} | ({"doc_ids": doc_ids} if documents else {}))
    return out


def sweep1(model, data, monkeypatch, layers_per_call):
    """(stats, heads of each attention_sums call) of sweep 1 over every layer."""
    calls = []

    def counted(q, *args, **kwargs):
        calls.append(q.shape[1])
        return moments.attention_sums(q, *args, **kwargs)

    monkeypatch.setattr(sweep_attention, "attention_sums", counted)
    got = collect_attention_stats(model, data, range(len(KINDS)), {"teacher_sha256": "t"}, chunk_size=6,
                                  progress=False, layers_per_call=layers_per_call)
    return got, calls


@pytest.mark.parametrize("documents", [False, True])
def test_stacked_calls_give_the_sums_of_a_call_per_layer(monkeypatch, documents):
    model, data = teacher(), batches(documents)
    alone, alone_calls = sweep1(model, data, monkeypatch, 1)
    stacked, stacked_calls = sweep1(model, data, monkeypatch, None)
    pairs, pairs_calls = sweep1(model, data, monkeypatch, 2)
    assert alone_calls == [4] * 6 * 3
    assert stacked_calls == [3 * 4, 3 * 4] * 3  # per batch: the sliding layers, then the full ones
    assert pairs_calls == [2 * 4, 2 * 4, 4, 4] * 3  # layers 0+2, 1+4, then 3 and 5 at the batch's end
    assert alone.sums.keys() == stacked.sums.keys() == pairs.sums.keys()
    # the per-query statistics are fp32 (an fp64 teacher too): matmuls over more heads round
    # differently, so the tolerance is that of the chunked sums against the full matrix
    for key, want in alone.sums.items():
        for got in (stacked.sums[key], pairs.sums[key]):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=key)


def test_the_stack_fits_its_memory_and_the_kernel_grid():
    smollm2 = ArchConfig(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, intermediate_size=1536)
    per_layer = 20 * 4 * 2048 * 9 * 64  # fp32 / fp64 temporaries of one layer's heads, 4 rows of 2048
    assert stacked_layers(smollm2, (4, 2048)) == stats_module.STACK_BYTES // per_layer == 22
    assert stacked_layers(smollm2, (4, 2048), tp=3) == stats_module.STACK_BYTES // (per_layer // 3)
    assert stacked_layers(smollm2, (1, 2048)) == stats_module.STACK_BYTES // (per_layer // 4) == 91
    assert stacked_layers(smollm2, (1, 16)) == 65535 // 9  # short rows: the grid (rows of programs) bounds it
    assert stacked_layers(smollm2, (64, 32768)) == 1  # larger than the budget alone: a call per layer


def test_zero_sums_are_views_of_one_zeroed_buffer_each_copy_its_own():
    shapes = {"a": (2, 3), "empty": (0, 4), "scalar": (), "b": (5,)}
    copies = moments.zero_views(shapes, "cpu", copies=3)
    assert len(copies) == 3
    storages = set()
    for copy in copies:
        assert list(copy) == list(shapes)
        for key, shape in shapes.items():
            assert copy[key].shape == shape and copy[key].dtype == torch.float64 and not copy[key].any(), key
        storages |= {v.untyped_storage().data_ptr() for v in copy.values() if v.numel()}
    assert len(storages) == 1  # one fill for every sum of every copy
    copies[1]["a"] += 1.0
    copies[1]["scalar"] += 2.0
    assert not copies[0]["a"].any() and not copies[2]["a"].any() and not copies[1]["b"].any()
    assert float(copies[1]["scalar"]) == 2.0 and float(copies[2]["scalar"]) == 0.0
