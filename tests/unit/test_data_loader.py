"""Sampling: DP shards partition the single-process global batch in order; epochs reshuffle;
a resumed loader yields exactly the batches an uninterrupted one would."""
import numpy as np
import pytest
import torch

from megatron_tc.data import DataError, DistributedBatchLoader, PackedSequences, TokenStream

SEQ_LEN = 4


def _dataset(num_seqs: int = 37, fingerprint: str = "k") -> PackedSequences:
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < num_seqs * SEQ_LEN + 1:
        lengths.append(int(rng.integers(1, 9)))
    docs, start = [], 0
    for n in lengths:  # token value = its stream position: every sequence is identifiable
        docs.append(list(range(start, start + n)))
        start += n
    stream = TokenStream.from_token_lists(docs)
    ds = PackedSequences(stream, SEQ_LEN, pad_id=-1, drop_last=True, fingerprint=fingerprint)
    assert len(ds) >= num_seqs
    return ds


def _seq_ids(batches: list[dict]) -> list[int]:
    """Sequence index of every row of a list of micro-batches (first input token // SEQ_LEN)."""
    return [int(r) // SEQ_LEN for b in batches for r in b["input_ids"][:, 0]]


@pytest.mark.parametrize("dp_size,mbs", [(2, 2), (4, 1), (2, 1)])
def test_union_of_rank_batches_is_the_single_process_global_batch(dp_size, mbs):
    ds = _dataset()
    single = DistributedBatchLoader(ds, global_batch_size=8, micro_batch_size=2, seed=7)
    ranks = [DistributedBatchLoader(ds, 8, mbs, dp_rank=r, dp_size=dp_size, seed=7) for r in range(dp_size)]
    assert ranks[0].grad_accum_steps == 8 // (mbs * dp_size)
    for _ in range(2 * single.steps_per_epoch + 1):  # crosses two epoch boundaries
        ref = single.next_step()
        per_rank = [r.next_step() for r in ranks]
        assert all(b["input_ids"].shape == (mbs, SEQ_LEN) for rank in per_rank for b in rank)
        ids = [_seq_ids(rank) for rank in per_rank]
        assert sum(ids, []) == _seq_ids(ref)  # same sequences, same order
        assert len(set(sum(ids, []))) == 8  # disjoint across ranks
        for key in ("input_ids", "labels", "doc_ids", "position_ids"):
            got = torch.cat([b[key] for rank in per_rank for b in rank])
            assert torch.equal(got, torch.cat([b[key] for b in ref]))


def test_epochs_visit_distinct_sequences_and_reshuffle():
    ds = _dataset()
    loader = DistributedBatchLoader(ds, 8, 4, seed=1)
    spe = loader.steps_per_epoch
    epochs = [[i for _ in range(spe) for i in _seq_ids(loader.next_step())] for _ in range(3)]
    for e in epochs:
        assert len(e) == len(set(e)) == spe * 8
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])
    ordered = DistributedBatchLoader(ds, 8, 4, seed=1, shuffle=False)
    assert _seq_ids(ordered.next_step()) == list(range(8))
    other_seed = DistributedBatchLoader(ds, 8, 4, seed=2)
    assert _seq_ids(other_seed.next_step()) != epochs[0][:8]


@pytest.mark.parametrize("k", [0, 3, 4, 9])
def test_resume_yields_the_uninterrupted_batches(k):
    ds = _dataset()
    straight = DistributedBatchLoader(ds, 8, 2, dp_rank=1, dp_size=2, seed=3)
    expected = [straight.next_step() for _ in range(k + 5)][k:]
    first = DistributedBatchLoader(ds, 8, 2, dp_rank=1, dp_size=2, seed=3)
    for _ in range(k):
        first.next_step()
    state = first.state_dict()
    assert state["step"] == k and state["epoch"] == k // first.steps_per_epoch
    assert state["offset"] == (k % first.steps_per_epoch) * 8
    resumed = DistributedBatchLoader(ds, 8, 2, dp_rank=1, dp_size=2, seed=3)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_step()
        assert all(torch.equal(g[key], w[key]) for g, w in zip(got, want) for key in w)


def test_resume_with_another_dp_size_keeps_the_global_order():
    ds = _dataset()
    two = [DistributedBatchLoader(ds, 8, 2, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    for _ in range(3):
        for ld in two:
            ld.next_step()
    state = two[0].state_dict()
    four = [DistributedBatchLoader(ds, 8, 2, dp_rank=r, dp_size=4, seed=5) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    single = DistributedBatchLoader(ds, 8, 8, seed=5)
    single.load_state_dict(state)
    assert sum((_seq_ids(ld.next_step()) for ld in four), []) == _seq_ids(single.next_step())


def test_resume_refuses_other_data_or_settings():
    state = DistributedBatchLoader(_dataset(), 8, 2, seed=3).state_dict()
    with pytest.raises(DataError, match="seed"):
        DistributedBatchLoader(_dataset(), 8, 2, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch_size"):
        DistributedBatchLoader(_dataset(), 16, 2, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="dataset"):
        DistributedBatchLoader(_dataset(fingerprint="other"), 8, 2, seed=3).load_state_dict(state)


def test_bad_batch_settings_are_refused():
    ds = _dataset()
    with pytest.raises(DataError, match="multiple"):
        DistributedBatchLoader(ds, 6, 2, dp_rank=0, dp_size=2)
    with pytest.raises(DataError, match="dp_rank"):
        DistributedBatchLoader(ds, 8, 2, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="fewer than one global batch"):
        DistributedBatchLoader(ds, 64, 2)
